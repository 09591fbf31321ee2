"""Loop devices set up in another mount namespace are still found by their backing file.

In Kubernetes the storage node's pool is attached by an init container and
the volumes by earlier containers of the storage node: sysfs then names the
backing file relative to a mount this namespace never had (``/pool.img``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from backend.loopdevices import detach_loops, loop_devices


def test_loop_attached_in_a_vanished_mount_namespace_is_found(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    image = data / "pool.img"
    with image.open("wb") as f:
        f.truncate(16 << 20)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # attach through a bind mount that exists only in a short-lived namespace
    script = f"mount --bind {data} {elsewhere} && losetup -f --show {elsewhere}/pool.img"
    device = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        back = Path(f"/sys/block/{Path(device).name}/loop/backing_file").read_text().strip()
        assert back == "/pool.img"  # what sysfs can say from here
        assert loop_devices(image) == [device]
        assert loop_devices(data) == [device]
        other = tmp_path / "other.img"
        other.write_bytes(b"")
        assert loop_devices(other) == []
        detach_loops(image)
        assert loop_devices(image) == []
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)

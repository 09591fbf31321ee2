"""A kernel nbd device whose storage node goes away (issue 18's bound, on the
kernel path): the device's request and dead-connection timeouts come from
``--io-timeout`` (half each), and ``moorage attach watch`` (what the CSI node
plugin runs in a thread) hands the kernel a new connection when the storage
node is back (NBD_CMD_LINK_DEAD, then NBD_CMD_RECONFIGURE).

- back within the bound: a pause; the writer blocked meanwhile completes,
  and everything written reads back equal after a fresh attach;
- gone longer: I/O fails (the writer gets an error instead of hanging), and
  once the storage node is back the same device works again.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import pytest

from backend.api.proto import backend_pb2 as pb
from tests.conftest import REPO
from tests.kernel.conftest import Store
from tests.kernel.guest import Lane

MIB = 1 << 20
SIZE = 256 * MIB
MOORAGE = str(REPO / ".venv/bin/moorage")


@pytest.fixture
def watching(guest: Lane) -> Iterator[None]:
    guest.spawn("watch", MOORAGE, "-v", "attach", "watch", log="/tmp/attach-watch.log")
    deadline = time.monotonic() + 60
    while "watching" not in guest.run("cat", "/tmp/attach-watch.log").stdout:
        assert time.monotonic() < deadline, _what_happened(guest, "/dev/null")
        time.sleep(0.5)
    try:
        yield
    finally:
        guest.signal("watch", signal.SIGTERM)
        assert guest.wait("watch", 30) == 0


def _attach(guest: Lane, store: Store, volume: pb.Volume, io_timeout: int) -> str:
    nbd = store.publish(volume).nbd
    uri = f"nbd://{nbd.host}:{nbd.port}/{nbd.export_name}"
    out = guest.moorage("attach", "nbd", uri, "--json", "--io-timeout", str(io_timeout))
    device = str(json.loads(out.stdout)["device"])
    assert device.startswith("/dev/nbd"), out.stdout
    return device


def _what_happened(guest: Lane, log: str) -> str:
    out = guest.sh(f"cat {log} /tmp/attach-watch.log; dmesg | tail -40", check=False)
    return out.stdout + out.stderr


def _sums(guest: Lane, mnt: str) -> list[str]:
    return guest.sh(f"cd {mnt} && sha256sum before during").stdout.split()


def test_a_storage_node_back_within_the_bound_is_a_pause(
    guest: Lane, store: Store, watching: None
) -> None:
    volume = store.volume("nbd", SIZE)
    device = _attach(guest, store, volume, io_timeout=120)
    mnt = f"/mnt/{volume.name}"
    try:
        guest.sh(f"mkfs.ext4 -q {device} && mkdir -p {mnt} && mount {device} {mnt}\n"
                 f"head -c {8 * MIB} /dev/urandom > {mnt}/before && sync {mnt}/before")  # fmt: skip
        assert store.node.stop() == 0
        # blocks while the storage node is away
        guest.spawn("writer", "sh", "-euc",
                    f"head -c {8 * MIB} /dev/urandom > {mnt}/during && sync {mnt}/during",
                    log="/tmp/writer.log")  # fmt: skip
        time.sleep(3)
        store.node.start()
        assert guest.wait("writer", 120) == 0, _what_happened(guest, "/tmp/writer.log")
        assert "reconnected" in guest.run("cat", "/tmp/attach-watch.log").stdout
        sums = _sums(guest, mnt)
        guest.run("umount", mnt)
        guest.moorage("detach", device)
        # attached anew: what is read comes from the storage node
        device = _attach(guest, store, volume, io_timeout=120)
        guest.run("mount", "-o", "ro", device, mnt)
        assert _sums(guest, mnt) == sums
    finally:
        guest.run("umount", mnt, check=False)
        guest.moorage("detach", device, check=False)
        store.unpublish(volume)
        store.delete(volume)


def test_a_storage_node_gone_longer_than_the_bound_fails_io_then_the_device_works_again(
    guest: Lane, store: Store, watching: None
) -> None:
    volume = store.volume("nbd", SIZE)
    device = _attach(guest, store, volume, io_timeout=10)  # 5 s request, 5 s dead connection
    write = f"dd if=/dev/urandom of={device} bs=1M count=1 oflag=direct,sync status=none"
    read = f"dd if={device} of=/dev/null bs=1M count=1 iflag=direct status=none"
    try:
        guest.sh(write)
        assert store.node.stop() == 0
        failed = guest.sh(write, timeout=180, check=False)
        # an error, not a hang (the agent's timeout would say rc None)
        assert failed.rc not in (0, None), failed
        store.node.start()
        deadline = time.monotonic() + 90
        while guest.sh(read, check=False).rc != 0:
            assert time.monotonic() < deadline, _what_happened(guest, "/dev/null")
            time.sleep(1)
        guest.sh(write)
        assert "reconnected" in guest.run("cat", "/tmp/attach-watch.log").stdout
    finally:
        guest.moorage("detach", device, check=False)
        store.unpublish(volume)
        store.delete(volume)

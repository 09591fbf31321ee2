"""detach_loops waits for what holds a loop device, and names it when it gives up.

Under load ganesha's handles, a lazy unmount or udev's blkid can keep a loop
device open for seconds after its user is done with it.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.api.errors import FailedPrecondition
from backend.loopdevices import detach_loops, loop_devices, loop_holders


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A loop device (without autoclear) on a small image in tmp_path."""
    image = tmp_path / "held.img"
    with image.open("wb") as f:
        f.truncate(16 << 20)
    device = subprocess.run(
        ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield image, device
    finally:
        if device in loop_devices(image):
            subprocess.run(["losetup", "-d", device], capture_output=True)


def hold(device: str, seconds: float) -> subprocess.Popen[bytes]:
    """A process with ``device`` open (its stdin) for ``seconds``."""
    with open(device, "rb") as f:
        return subprocess.Popen(["sleep", str(seconds)], stdin=f)


def test_the_error_names_the_process_that_holds_the_device(loop: tuple[Path, str]) -> None:
    image, device = loop
    holder = hold(device, 60)
    try:
        assert f"pid {holder.pid} (sleep)" in loop_holders(device)
        started = time.monotonic()
        with pytest.raises(FailedPrecondition) as raised:
            detach_loops(image, wait=1.0)
        assert time.monotonic() - started < 10
        message = str(raised.value)
        assert "\n" not in message
        assert f"loop devices ['{device}'] of {image} could not be detached" in message
        assert f"held by pid {holder.pid} (sleep)" in message
    finally:
        holder.kill()
        holder.wait()
    # losetup -d marked it autoclear: it goes with its last holder
    deadline = time.monotonic() + 30
    while loop_devices(image) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop_devices(image) == []


def test_a_holder_that_lets_go_within_the_bound_is_waited_for(loop: tuple[Path, str]) -> None:
    image, device = loop
    holder = hold(device, 2)
    try:
        detach_loops(image, wait=30.0)
        assert holder.poll() is not None, "returned before the holder let go"
        assert loop_devices(image) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        holder.wait()


def test_a_mount_of_the_device_is_named(loop: tuple[Path, str], tmp_path: Path) -> None:
    image, device = loop
    subprocess.run(["mkfs.ext4", "-q", device], check=True, capture_output=True)
    mount_point = tmp_path / "mounted here"
    mount_point.mkdir()
    subprocess.run(["mount", device, str(mount_point)], check=True, capture_output=True)
    try:
        with pytest.raises(FailedPrecondition) as raised:
            detach_loops(image, wait=0.5)
        assert f"held by mounted on {mount_point}" in str(raised.value)
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)

"""Loop devices by backing file: finding the ones on a file or directory, detaching them.

A loop device is found by the path sysfs gives for its backing file or, when
it was set up in another mount namespace, by that file's device and inode.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
from pathlib import Path

from backend.commands import run
from backend.errors import CommandFailed, FailedPrecondition

log = logging.getLogger("moorage.backend.pool")

_TIMEOUT = 120.0
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64_SIZE = 232  # struct loop_info64


def loop_backing_id(device: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a loop device's backing file, from LOOP_GET_STATUS64."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = fcntl.ioctl(fd, _LOOP_GET_STATUS64, bytes(_LOOP_INFO64_SIZE))
    except OSError:
        return None
    finally:
        os.close(fd)
    encoded, inode = struct.unpack_from("=QQ", info)
    # the kernel's new_encode_dev: minor's low byte, major, then minor's high bits
    major = (encoded >> 8) & 0xFFF
    minor = (encoded & 0xFF) | ((encoded >> 12) & 0xFFF00)
    return os.makedev(major, minor), inode


def _file_ids(backing: Path) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of ``backing`` and of every file below it."""
    ids = set()
    paths = [backing]
    if backing.is_dir():
        for top, dirs, files in os.walk(backing):
            # not into the volumes' own filesystems mounted in the pool
            dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(top, d))]
            paths += [Path(top, f) for f in files]
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids


def loop_devices(backing: Path) -> list[str]:
    """Loop devices whose backing file is ``backing`` or lies below it (deleted ones too).

    Read from sysfs (what ``losetup --list`` reads too), without a process
    per call: deletes ask this several times each.  sysfs gives the path as
    the kernel can name it from here: a loop set up in another mount
    namespace (a pod's init container, an earlier container of this one)
    shows a path relative to a mount this namespace lacks, so such a loop
    is recognised by its backing file's device and inode instead.
    """
    found = []
    ids: set[tuple[int, int]] | None = None
    for entry in Path("/sys/block").glob("loop*"):
        try:
            back = (entry / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue  # not attached
        back = back.removesuffix(" (deleted)")
        if not back:
            continue
        if Path(back) == backing or backing in Path(back).parents:
            found.append(f"/dev/{entry.name}")
            continue
        if ids is None:
            ids = _file_ids(backing)
        if ids and loop_backing_id(f"/dev/{entry.name}") in ids:
            found.append(f"/dev/{entry.name}")
    return sorted(found)


def detach_loops(backing: Path, wait: float = 5.0) -> None:
    """Detach loop devices of ``backing``; autoclear ones get ``wait`` seconds to go alone."""
    devices = loop_devices(backing)
    if not devices:
        return
    deadline = time.monotonic() + wait
    while devices and time.monotonic() < deadline:
        time.sleep(0.05)
        devices = loop_devices(backing)
    for dev in devices:
        log.info("detaching %s (backed by %s)", dev, backing)
        with contextlib.suppress(CommandFailed):  # it may have gone by itself meanwhile
            run(["losetup", "-d", dev], timeout=_TIMEOUT)
    left = loop_devices(backing)
    if left:
        raise FailedPrecondition(f"loop devices {left} of {backing} could not be detached")

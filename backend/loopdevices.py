"""Loop devices by backing file: finding the ones on a file or directory, detaching them.

A loop device is found by the path sysfs gives for its backing file or, when
it was set up in another mount namespace, by that file's device and inode.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import struct
import time
from pathlib import Path

from backend.api.errors import CommandFailed, FailedPrecondition
from backend.commands import run
from hostio.mountinfo import read_mountinfo

log = logging.getLogger("moorage.backend.pool")

_TIMEOUT = 120.0
# How long detach_loops waits for a loop device's holders to let go.
DETACH_WAIT = 60.0
# An autoclear device is left this long to go by itself before losetup -d,
# which is asked again this often while the device stays.
_ALONE = 1.0
_ASK_AGAIN = 5.0
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


def _backing_text(device: str) -> str | None:
    """What sysfs says backs ``device``, deleted or not (None once it is detached)."""
    try:
        text = Path("/sys/block", Path(device).name, "loop", "backing_file").read_text()
    except OSError:
        return None
    return text.strip().removesuffix(" (deleted)")


def _autoclear(device: str) -> bool:
    """Whether the kernel detaches ``device`` by itself at its last close."""
    try:
        flag = Path("/sys/block", Path(device).name, "loop", "autoclear").read_text()
    except OSError:
        return False
    return flag.strip() == "1"


def detach_loops(backing: Path, wait: float = DETACH_WAIT) -> None:
    """Detach the loop devices of ``backing``, waiting up to ``wait`` seconds for
    what still holds one to let go.

    ``losetup -d`` on a device in use only marks it autoclear: the kernel
    detaches it at its last close, once ganesha closes its handles, a lazy
    unmount finishes or udev's blkid is done.  An autoclear device (a mount
    just undone) is left a moment to go by itself.  Waiting reads sysfs only;
    when the time is up, the error names what holds each device left
    (:func:`loop_holders`).  The bound allows for a busy machine.
    """
    devices = loop_devices(backing)
    if not devices:
        return
    started = time.monotonic()
    deadline = started + wait
    alone = min(_ALONE, wait / 2)
    ours = {dev: _backing_text(dev) for dev in devices}
    asked: dict[str, float] = {}
    delay = 0.02
    while True:
        devices = [dev for dev in devices if _backing_text(dev) == ours[dev]]
        if not devices:
            # gone, unless one was attached meanwhile
            devices = loop_devices(backing)
            if not devices:
                return
            ours.update({dev: _backing_text(dev) for dev in devices})
        now = time.monotonic()
        if now >= deadline:
            break
        for dev in devices:
            if now - asked.get(dev, -_ASK_AGAIN) < _ASK_AGAIN:
                continue
            if now - started >= alone or not _autoclear(dev):
                asked[dev] = now
                log.info("detaching %s (backed by %s)", dev, backing)
                with contextlib.suppress(CommandFailed):  # it may have gone meanwhile
                    run(["losetup", "-d", dev], timeout=_TIMEOUT)
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)
    held = "; ".join(f"{dev} {_describe(loop_holders(dev))}" for dev in devices)
    raise FailedPrecondition(
        f"loop devices {devices} of {backing} could not be detached in {wait:g} s: {held}"
    )


def _describe(holders: list[str]) -> str:
    if not holders:
        return (
            "has no holder found (a lazily unmounted filesystem still in use, "
            "or a reference the kernel keeps)"
        )
    return "held by " + ", ".join(holders)


def loop_holders(device: str) -> list[str]:
    """What holds ``device`` open: stacked devices (sysfs ``holders``), mounts of it
    in any mount namespace, and processes with it open (``/proc/*/fd``).

    Reads all of /proc: for an error message, not for polling.
    """
    name = Path(device).name
    sysdir = Path("/sys/block", name)
    found = [f"device {h.name}" for h in sorted((sysdir / "holders").glob("*"))]
    try:
        numbers = (sysdir / "dev").read_text().strip()
        major, minor = (int(n) for n in numbers.split(":"))
    except (OSError, ValueError):
        return found
    rdev = os.makedev(major, minor)
    try:
        own_namespace = os.readlink("/proc/self/ns/mnt")
    except OSError:
        own_namespace = ""
    namespaces: set[str] = set()
    openers: list[str] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            namespace = os.readlink(proc / "ns" / "mnt")
        except OSError:
            namespace = ""
        if namespace and namespace not in namespaces:
            namespaces.add(namespace)
            where = "" if namespace == own_namespace else f" (mount namespace of pid {proc.name})"
            found += [f"mounted on {m}{where}" for m in _mounts_of(int(proc.name), major, minor)]
        try:
            fds = os.listdir(proc / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(proc / "fd" / fd)
                # stat only device nodes: other files may be on a hung FUSE mount
                if not (target.startswith("/dev/") or Path(target).name == name):
                    continue
                st = os.stat(proc / "fd" / fd)
            except OSError:
                continue
            if stat.S_ISBLK(st.st_mode) and st.st_rdev == rdev:
                try:
                    command = (proc / "comm").read_text().strip()
                except OSError:
                    command = "?"
                openers.append(f"pid {proc.name} ({command})")
                break
    return found + openers


def _mounts_of(pid: int, major: int, minor: int) -> list[str]:
    """Mount points of device ``major:minor`` in process ``pid``'s mount namespace."""
    try:
        entries = read_mountinfo(pid)
    except OSError:  # it has exited
        return []
    return [e.mount_point for e in entries if (e.major, e.minor) == (major, minor)]

"""``/dev/fuse`` and mount(2) for a FUSE server of our own (no libfuse).

:func:`mount` opens ``/dev/fuse`` and mounts it as root does with libfuse 3
(``fusermount3`` is only needed without privilege): ``mount(fsname, target,
"fuse.SUBTYPE", MS_NOSUID|MS_NODEV, "fd=N,rootmode=40000,user_id=U,group_id=G,...")``,
so ``findmnt`` and ``/proc/mounts`` show what they showed under pyfuse3.
:func:`clone` gives another descriptor for the same connection
(``FUSE_DEV_IOC_CLONE``), which another process may serve.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Iterable
from typing import Final

from fuse.fuseproto import DEV_IOC_CLONE

DEVICE: Final = "/dev/fuse"
MS_NOSUID: Final = 2
MS_NODEV: Final = 4
MNT_DETACH: Final = 2

_libc = ctypes.CDLL(None, use_errno=True)
_mount = _libc.mount
_mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_mount.restype = ctypes.c_int
_umount2 = _libc.umount2
_umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_umount2.restype = ctypes.c_int


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", path)


def mount(
    mountpoint: str | os.PathLike[str],
    fsname: str,
    subtype: str,
    options: Iterable[str] = (),
) -> int:
    """Mount a new FUSE connection on ``mountpoint``; its descriptor (non-blocking,
    close-on-exec).  ``options``: kernel mount options (``default_permissions``,
    ``allow_other``, ``max_read=N``)."""
    target = os.fspath(mountpoint)
    for value in (fsname, subtype, *options):
        if "," in value or "\0" in value:
            raise ValueError(f"a mount option may not contain a comma: {value!r}")
    mode = os.stat(target).st_mode & 0o170000
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        data = [f"fd={fd}", f"rootmode={mode:o}", f"user_id={os.getuid()}"]
        data += [f"group_id={os.getgid()}", *options]
        result = _mount(
            fsname.encode(),
            target.encode(),
            f"fuse.{subtype}".encode(),
            MS_NOSUID | MS_NODEV,
            ",".join(data).encode(),
        )
        _check(result, "mount", target)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unmount(mountpoint: str | os.PathLike[str]) -> bool:
    """Lazily unmount (users of the file, a loop device, keep it until they let go).
    False if nothing was mounted there any more."""
    target = os.fspath(mountpoint)
    if _umount2(target.encode(), MNT_DETACH) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):
        return False
    raise OSError(code, f"umount: {os.strerror(code)}", target)


def clone(fd: int) -> int:
    """A further descriptor for the FUSE connection of ``fd`` (non-blocking, and
    inheritable: it is meant for a worker process)."""
    new = os.open(DEVICE, os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(new, DEV_IOC_CLONE, struct.pack("=I", fd))
    except BaseException:
        os.close(new)
        raise
    return new

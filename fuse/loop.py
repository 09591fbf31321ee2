"""Loop devices: a regular file as a block device (``/dev/loopN``).

The FUSE block file (:mod:`fuse.blockfile`) becomes a block device here, on
hosts without the kernel NBD client.  Everything is ioctls on the loop
driver (``linux/loop.h``); ``losetup`` is only the fallback for kernels
without ``LOOP_CONFIGURE`` (before 5.8).

Choices, and why:

- **One ioctl to attach.** ``LOOP_CONFIGURE`` binds the file and sets the
  flags and block size at once, so no half-configured device is ever
  visible; the number comes from ``LOOP_CTL_GET_FREE`` and a race with
  another attacher (``EBUSY``) is retried with the next free one.
- **No autoclear.** ``LO_FLAGS_AUTOCLEAR`` detaches when the last opener
  closes: the attaching command itself is the first opener, so the device
  would vanish as soon as it returned.  A device that must outlive the
  command that made it (the CSI node stages it, a mount opens it later) is
  detached explicitly with :func:`detach_loop`.
- **Direct I/O when the backing file takes it.** Without
  ``LO_FLAGS_DIRECT_IO`` the loop driver reads and writes the file through
  its page cache, so every block is cached twice (once for the device, once
  for the file).  A kernel that cannot do direct I/O on the file refuses the
  flag (or drops it): the attach is then retried without it.
- **Detach refuses a device in use.** ``LOOP_CLR_FD`` on a device somebody
  still holds open only marks it for autoclear and returns 0; the backing
  file (the FUSE process) must not go away then, so a mounted device is
  refused up front and a deferred detach is waited for, then reported.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from hostio import tools
from hostio.mountinfo import read_mountinfo

if TYPE_CHECKING:
    from _typeshed import StrPath

log = logging.getLogger("moorage.fuse.loop")

# ------------------------------------------------------------------ linux/loop.h

LO_NAME_SIZE: Final = 64
LO_KEY_SIZE: Final = 32

LO_FLAGS_READ_ONLY: Final = 1
LO_FLAGS_AUTOCLEAR: Final = 4
LO_FLAGS_PARTSCAN: Final = 8
LO_FLAGS_DIRECT_IO: Final = 16

LOOP_SET_FD: Final = 0x4C00
LOOP_CLR_FD: Final = 0x4C01
LOOP_SET_STATUS: Final = 0x4C02
LOOP_GET_STATUS: Final = 0x4C03
LOOP_SET_STATUS64: Final = 0x4C04
LOOP_GET_STATUS64: Final = 0x4C05
LOOP_CHANGE_FD: Final = 0x4C06
LOOP_SET_CAPACITY: Final = 0x4C07
LOOP_SET_DIRECT_IO: Final = 0x4C08
LOOP_SET_BLOCK_SIZE: Final = 0x4C09
LOOP_CONFIGURE: Final = 0x4C0A

LOOP_CTL_ADD: Final = 0x4C80
LOOP_CTL_REMOVE: Final = 0x4C81
LOOP_CTL_GET_FREE: Final = 0x4C82

LOOP_MAJOR: Final = 7
LOOP_CONTROL: Final = "/dev/loop-control"
SYS_BLOCK: Final = Path("/sys/block")


class LoopInfo64(ctypes.Structure):
    """``struct loop_info64``."""

    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * LO_NAME_SIZE),
        ("lo_crypt_name", ctypes.c_uint8 * LO_NAME_SIZE),
        ("lo_encrypt_key", ctypes.c_uint8 * LO_KEY_SIZE),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class LoopConfig(ctypes.Structure):
    """``struct loop_config``, the argument of ``LOOP_CONFIGURE``."""

    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


# ------------------------------------------------------------------ errors


class LoopError(OSError):
    """A loop device operation failed."""


class LoopBusy(LoopError):
    """The device is mounted or held open, so it is not detached (yet)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EBUSY, message)


# ------------------------------------------------------------------ queries


@dataclass(frozen=True)
class LoopStatus:
    """What sysfs says about a bound loop device."""

    device: str
    backing_file: str
    size: int  # bytes
    direct_io: bool
    autoclear: bool
    read_only: bool


def _name(device: StrPath) -> str:
    """``loop3`` from ``/dev/loop3`` (or ``loop3``); anything else is refused."""
    name = os.path.basename(os.fspath(device))
    if not (name.startswith("loop") and name[4:].isdigit()):
        raise ValueError(f"not a loop device: {os.fspath(device)!r}")
    return name


def _sys(device: StrPath) -> Path:
    return SYS_BLOCK / _name(device)


def _read_sys(path: Path) -> str | None:
    try:
        return path.read_text().rstrip("\n")
    except (FileNotFoundError, NotADirectoryError):
        return None


def loop_backing_file(device: StrPath) -> str | None:
    """The file behind ``device`` (``None`` when unbound), from sysfs.

    A backing file deleted since ends in `` (deleted)``, as the kernel says.
    """
    return _read_sys(_sys(device) / "loop" / "backing_file")


def loop_status(device: StrPath) -> LoopStatus | None:
    """Backing file, size and flags of a bound device; ``None`` when it is not bound."""
    sys_dir = _sys(device)
    backing = loop_backing_file(device)
    if backing is None:
        return None
    sectors = _read_sys(sys_dir / "size") or "0"
    return LoopStatus(
        device=f"/dev/{_name(device)}",
        backing_file=backing,
        size=int(sectors) * 512,
        direct_io=_read_sys(sys_dir / "loop" / "dio") == "1",
        autoclear=_read_sys(sys_dir / "loop" / "autoclear") == "1",
        read_only=_read_sys(sys_dir / "ro") == "1",
    )


def find_loops(backing: StrPath) -> list[str]:
    """Every loop device bound to ``backing`` (compared as absolute paths)."""
    target = os.path.abspath(os.fspath(backing))
    found = []
    for entry in sorted(SYS_BLOCK.glob("loop*"), key=lambda p: (len(p.name), p.name)):
        file = _read_sys(entry / "loop" / "backing_file")
        if file is not None and file.removesuffix(" (deleted)") == target:
            found.append(f"/dev/{entry.name}")
    return found


def _dev_number(device: StrPath) -> tuple[int, int] | None:
    text = _read_sys(_sys(device) / "dev")
    if text is None:
        return None
    major, minor = text.split(":")
    return int(major), int(minor)


def loop_mountpoints(device: StrPath) -> list[str]:
    """Where the device is mounted (by device number, from /proc/self/mountinfo)."""
    number = _dev_number(device)
    if number is None:
        return []
    return [e.mount_point for e in read_mountinfo() if (e.major, e.minor) == number]


def _holders(device: StrPath) -> list[str]:
    try:
        return sorted(os.listdir(_sys(device) / "holders"))
    except FileNotFoundError:
        return []


# ------------------------------------------------------------------ attach


def _device_node(number: int) -> str:
    """``/dev/loopN``, made if this /dev (a container's) lacks it."""
    path = f"/dev/loop{number}"
    if not os.path.exists(path):
        dev = _dev_number(path) or (LOOP_MAJOR, number)
        os.mknod(path, stat.S_IFBLK | 0o660, os.makedev(*dev))
    return path


def _c_name(path: str) -> ctypes.Array[ctypes.c_uint8]:
    raw = os.fsencode(path)[: LO_NAME_SIZE - 1]
    return (ctypes.c_uint8 * LO_NAME_SIZE).from_buffer_copy(raw.ljust(LO_NAME_SIZE, b"\0"))


def _configure(backing_fd: int, name: str, flags: int, block_size: int, attempts: int = 16) -> str:
    """``LOOP_CTL_GET_FREE`` + ``LOOP_CONFIGURE``; retried when another attacher wins."""
    config = LoopConfig()
    config.fd = backing_fd
    config.block_size = block_size
    config.info.lo_flags = flags
    config.info.lo_file_name = _c_name(name)
    control = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(attempts):
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            device = _device_node(number)
            fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, bytes(config))
            except OSError as e:
                if e.errno == errno.EBUSY:  # bound by somebody else since GET_FREE
                    continue
                raise
            finally:
                os.close(fd)
            return device
    finally:
        os.close(control)
    raise LoopError(errno.EBUSY, f"no free loop device after {attempts} attempts")


def _losetup(
    backing: str, *, read_only: bool, direct_io: bool, block_size: int, timeout: float
) -> str:
    argv = ["losetup", "--find", "--show", f"--direct-io={'on' if direct_io else 'off'}"]
    if read_only:
        argv.append("--read-only")
    if block_size:
        argv += ["--sector-size", str(block_size)]
    argv.append(backing)
    try:
        return tools.run(argv, timeout=timeout).stdout.strip()
    except tools.ToolError as e:
        code = errno.ETIMEDOUT if isinstance(e, tools.ToolTimedOut) else errno.EIO
        raise LoopError(code, str(e)) from e


def attach_loop(
    backing: StrPath,
    *,
    read_only: bool = False,
    direct_io: bool = True,
    block_size: int = 0,
    timeout: float = 30.0,
) -> str:
    """Bind a free loop device to ``backing``; its path (``/dev/loopN``).

    ``direct_io``: ask for ``LO_FLAGS_DIRECT_IO``, and attach without it where
    the kernel refuses it for this file (see :func:`loop_status` for what
    was granted).  ``block_size``: the device's logical block size, 0 for the
    kernel's default (512, or the file's direct I/O alignment).  The device
    is never autoclear: :func:`detach_loop` undoes this.
    """
    path = os.path.abspath(os.fspath(backing))
    if block_size and (block_size < 512 or block_size > 4096 or block_size & (block_size - 1)):
        raise ValueError(f"block size must be 0 or a power of two in 512..4096: {block_size}")
    if not os.path.exists(LOOP_CONTROL):
        return _losetup(
            path, read_only=read_only, direct_io=direct_io, block_size=block_size, timeout=timeout
        )
    flags = LO_FLAGS_READ_ONLY if read_only else 0
    fd = os.open(path, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
    try:
        tries = [flags | LO_FLAGS_DIRECT_IO, flags] if direct_io else [flags]
        for i, attempt in enumerate(tries):
            try:
                device = _configure(fd, path, attempt, block_size)
            except OSError as e:
                if e.errno == errno.ENOTTY:  # kernel before 5.8: no LOOP_CONFIGURE
                    log.info("LOOP_CONFIGURE unsupported; using losetup")
                    return _losetup(
                        path,
                        read_only=read_only,
                        direct_io=direct_io,
                        block_size=block_size,
                        timeout=timeout,
                    )
                if e.errno == errno.EINVAL and i + 1 < len(tries):
                    log.info("%s: no direct I/O on this file (%s); attaching buffered", path, e)
                    continue
                raise LoopError(e.errno, f"cannot attach a loop device to {path}: {e}") from e
            log.info("attached %s to %s (flags %#x)", device, path, attempt)
            return device
    finally:
        os.close(fd)  # the loop driver holds its own reference
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ change, detach


def refresh_capacity(device: StrPath) -> int:
    """``LOOP_SET_CAPACITY``: re-read the backing file's size; the new size in bytes."""
    path = f"/dev/{_name(device)}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, LOOP_SET_CAPACITY, 0)
    finally:
        os.close(fd)
    status = loop_status(path)
    if status is None:
        raise LoopError(errno.ENXIO, f"{path} is not bound")
    return status.size


def detach_loop(device: StrPath, *, timeout: float = 10.0) -> bool:
    """Unbind ``device`` from its file; False if it was not bound.

    A mounted (or otherwise held) device raises :class:`LoopBusy` and stays
    as it is.  ``LOOP_CLR_FD`` is retried while the driver says ``EBUSY``;
    a device that some process still has open is detached by the kernel when
    that process closes it, which is waited for up to ``timeout`` seconds and
    otherwise reported as :class:`LoopBusy` (the detach stays scheduled).
    """
    path = f"/dev/{_name(device)}"
    if loop_backing_file(path) is None:
        return False
    mounts = loop_mountpoints(path)
    if mounts:
        raise LoopBusy(f"{path} is mounted on {', '.join(mounts)}")
    holders = _holders(path)
    if holders:
        raise LoopBusy(f"{path} is held by {', '.join(holders)}")
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.ioctl(fd, LOOP_CLR_FD, 0)
            break
        except OSError as e:
            if e.errno == errno.ENXIO:  # not bound (any more)
                return False
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise LoopError(e.errno, f"cannot detach {path}: {e}") from e
        finally:
            os.close(fd)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    # The kernel tears the device down when its last opener (maybe us, just
    # now) closes it.
    while loop_backing_file(path) is not None:
        if time.monotonic() > deadline:
            raise LoopBusy(f"{path} is still open somewhere; it detaches when closed")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    log.info("detached %s", path)
    return True

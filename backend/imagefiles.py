"""Image files that only appear under their final name complete.

A file is built under a hidden ``.<name>.tmp-<token>`` beside its final
name, fsynced, then hard-linked into place, which never replaces a file
already there; a crash leaves at most temporary files (their names hold
:data:`TEMP_MARK`).  Copies are reflinks (FICLONE) where the filesystem
shares extents, otherwise sparse: only the data extents (SEEK_DATA /
SEEK_HOLE) are copied, so holes stay holes.

An image can also be given real blocks up front (:func:`allocate`,
fallocate mode 0): what an nfs volume's loop-mounted filesystem writes then
never needs space the pool may no longer have.  Running out of pool space
here is :class:`~backend.api.errors.ResourceExhausted`, never a bare ENOSPC.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from pathlib import Path

from backend.api.errors import AlreadyExists, ResourceExhausted
from hostio.atomicfile import fsync_directory, fsync_path
from hostio.extents import data_extents

MiB = 1 << 20
FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
TEMP_MARK = ".tmp-"
NO_REFLINK = {errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS}
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def _clone_or_copy(src_fd: int, dst_fd: int) -> bool:
    """Reflink ``src`` into ``dst`` (True) or copy its data extents only (False)."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError as e:
        if e.errno not in NO_REFLINK:
            raise
    size = os.fstat(src_fd).st_size
    for data, hole in data_extents(src_fd, 0, size):
        _copy_range(src_fd, dst_fd, data, hole - data)
    os.ftruncate(dst_fd, size)
    return False


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    end = offset + length
    while offset < end:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(end - offset, 1 << 30), offset, offset)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            n = os.pwrite(dst_fd, os.pread(src_fd, min(end - offset, 4 * MiB), offset), offset)
        if n == 0:  # the source shrank under us
            return
        offset += n


def temp_for(final: Path) -> Path:
    """A fresh hidden temporary name beside ``final``."""
    return final.with_name(f".{final.name}{TEMP_MARK}{secrets.token_hex(4)}")


def publish(temp: Path, final: Path) -> None:
    """Give a complete temp file its final name, never replacing an existing file."""
    fsync_path(temp)
    try:
        os.link(temp, final)
    except FileExistsError as e:
        raise AlreadyExists(f"{final} already exists") from e
    finally:
        temp.unlink(missing_ok=True)
    fsync_directory(final.parent)


def make_sparse_file(path: Path, size: int, mode: int) -> None:
    """A new file of ``size`` bytes, all hole."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def copy_into(src: Path, temp: Path) -> bool:
    """Reflink or sparse-copy ``src`` into a new file ``temp``; True if reflinked.

    A pool too full for the copy is ResourceExhausted (``temp`` is the caller's to remove).
    """
    src_fd = os.open(src, os.O_RDONLY)
    try:
        dst_fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            return _clone_or_copy(src_fd, dst_fd)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            raise _no_space(dst_fd, f"a copy of {src.name}", os.fstat(src_fd).st_size) from e
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def data_bytes(path: Path) -> int:
    """Bytes of ``path`` in data extents (SEEK_DATA): what a copy or a reflink takes along.

    Preallocated blocks never written count as holes, as FICLONE leaves them
    behind (XFS shares only written extents) and the sparse copy skips them.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(hole - data for data, hole in data_extents(fd))
    finally:
        os.close(fd)


def allocate(path: Path, offset: int, length: int) -> None:
    """Give ``path`` real blocks for ``[offset, offset + length)`` (fallocate mode 0).

    The file grows to the end of the range if it is shorter.  Blocks already
    there are left as they are: in particular a range a reflinked copy
    shares stays shared (mode 0 does not unshare it), so overwriting it later
    still needs pool space for the copy-on-write.  No room in the pool is
    ResourceExhausted, and whatever fallocate allocated before failing past
    the file's old end is given back (the file keeps its old size).
    """
    if length <= 0:
        return
    fd = os.open(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            os.ftruncate(fd, size)  # frees blocks allocated beyond the old end
            raise _no_space(fd, path.name, length) from e
    finally:
        os.close(fd)


def _no_space(fd: int, what: str, needed: int) -> ResourceExhausted:
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    return ResourceExhausted(
        f"the pool is out of space for {what}: {needed} bytes needed, {free} bytes free"
    )

"""One NBD export as one regular file, for a loop device on hosts without kernel NBD.

:class:`BlockFile` is a pyfuse3 filesystem with two files: ``disk``, whose
bytes are the export's (its size is the export's size), and ``refresh``, a
control file: writing anything to it reconnects to the server and re-reads
the export size (moorage's server and qemu-nbd read it at connect).  It runs
in a process of its own (``python -m fuse.blockfile NBD_URI MOUNTPOINT``)
that lives as long as the mount; :mod:`fuse.blockdev` puts a loop device on
``disk``.

Requests reach the server through :class:`fuse.nbdconnections.ExportConnections`
(multi-conn, many requests in flight, a hard mount over reconnects).

Choices, and why:

- **direct_io.** ``disk`` is opened with FUSE ``direct_io`` and the loop
  device is attached with ``LO_FLAGS_DIRECT_IO``.  The filesystem on the
  loop device caches already; with neither flag the FUSE file's page cache
  holds every block a second time (measured: 512 MiB of it after writing and
  reading 512 MiB through the loop device, 0 with either flag).  Either one
  alone keeps the second copy out and the throughput of the combinations is
  the same within noise, so both are set: the FUSE flag still holds when a
  loop device is attached buffered (``losetup`` without ``--direct-io``),
  and a size refresh never meets stale cached pages.
- **No fallocate.** pyfuse3 3.5 does not dispatch FUSE_FALLOCATE (its
  ``fuse_lowlevel_ops`` leaves it NULL, libfuse answers ENOSYS, and the
  kernel then answers EOPNOTSUPP itself).  The loop device advertises
  discard and write-zeroes all the same; they fail with EOPNOTSUPP (the
  kernel logs it) until the loop driver, which clears a limit on that
  error, stops advertising them; the block layer then writes zeroes itself
  and ``mkfs`` goes without discard.
  :meth:`BlockFile.fallocate` is written for a pyfuse3 that dispatches it.
- **Reclaim.** ``PR_SET_IO_FLUSHER`` (Linux >= 5.6, needs CAP_SYS_RESOURCE)
  keeps this process's allocations from waiting for writeback of the very
  device it serves.  Where it is refused the process logs it and runs.
  The process writes only to its sockets and its log, never through a loop
  device of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar, cast

import pyfuse3
import trio

from fuse.nbdconnections import (
    DEFAULT_CONNECTIONS,
    DEFAULT_IO_TIMEOUT,
    MAX_IO_TIMEOUT,
    ExportConnections,
    ExportUnavailable,
)
from fuse.process import (
    EarlyStop,
    ReadySignal,
    configure_logging,
    raise_background_limit,
    run_fuse_loop,
)
from nbd.libnbd import CmdFlag, NBDError

log = logging.getLogger("moorage.fuse.blockfile")

FSTYPE: Final = "moorage-nbd"  # /proc/mounts says fuse.moorage-nbd
DISK: Final = "disk"
REFRESH: Final = "refresh"
DISK_INODE: Final = 2
REFRESH_INODE: Final = 3
# Asynchronous FUSE requests the kernel keeps in flight (its default: 12).  A
# loop device with direct I/O queues many; each waits for a round trip.
BACKGROUND_LIMIT: Final = 32
# Request tasks kept ready (see fuse.process.run_fuse_loop): the background
# requests plus a few synchronous ones (flush, getattr) at once.
REQUEST_TASKS: Final = BACKGROUND_LIMIT + 8
ATTR_TIMEOUT: Final = 1.0
FINAL_FLUSH_TIMEOUT: Final = 30.0
ZERO_CHUNK: Final = 1 << 30  # NBD lengths are 32 bits
PR_SET_IO_FLUSHER: Final = 57
FALLOC_FL_KEEP_SIZE: Final = 0x01
FALLOC_FL_PUNCH_HOLE: Final = 0x02
FALLOC_FL_ZERO_RANGE: Final = 0x10
_ENTRIES: Final = {DISK.encode(): DISK_INODE, REFRESH.encode(): REFRESH_INODE}

T = TypeVar("T")


# ------------------------------------------------------------------ the filesystem


class BlockFile(pyfuse3.Operations):
    """``disk`` (the export) and ``refresh`` (write to re-read its size)."""

    def __init__(
        self,
        export: ExportConnections,
        *,
        direct_io: bool = True,
        attr_timeout: float = ATTR_TIMEOUT,
    ) -> None:
        super().__init__()
        self.export = export
        self.direct_io = direct_io
        self.attr_timeout = attr_timeout
        self.uid, self.gid = os.geteuid(), os.getegid()
        self.mounted_ns = time.time_ns()  # constant times: a changed mtime drops caches
        self._files: dict[int, int] = {}  # fh -> inode
        self._next_fh = 1
        self._written = 0  # writes completed
        self._flushed = 0  # writes completed before the last FLUSH was sent

    # -------------------------------------------------------------- plumbing

    async def _call(self, request: Awaitable[T]) -> T:
        try:
            return await request
        except ExportUnavailable as e:
            log.error("%s", e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except NBDError as e:
            log.warning("%s", e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            # anything but FUSEError would end pyfuse3's loop, and the mount with it
            log.exception("unexpected error in an NBD call")
            raise pyfuse3.FUSEError(errno.EIO) from None

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            attr.st_mode = stat.S_IFDIR | 0o755
            attr.st_nlink = 2
        elif inode == DISK_INODE:
            attr.st_mode = stat.S_IFREG | (0o400 if self.export.read_only else 0o600)
            attr.st_nlink = 1
            attr.st_size = self.export.size
            attr.st_blocks = (self.export.size + 511) // 512
        elif inode == REFRESH_INODE:
            attr.st_mode = stat.S_IFREG | 0o200
            attr.st_nlink = 1
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        attr.st_ino = inode
        attr.generation = 0
        attr.entry_timeout = self.attr_timeout
        attr.attr_timeout = self.attr_timeout
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        attr.st_blksize = 4096
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self.mounted_ns
        return attr

    @property
    def open_files(self) -> int:
        return len(self._files)

    def _inode(self, fh: int) -> int:
        inode = self._files.get(fh)
        if inode is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return inode

    # -------------------------------------------------------------- names

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name in (b".", b".."):
            return self._attributes(pyfuse3.ROOT_INODE)
        inode = _ENTRIES.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(inode)

    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        return self._attributes(inode)

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        current = self._attributes(inode)
        if fields.update_size and attr.st_size != current.st_size and inode != REFRESH_INODE:
            raise pyfuse3.FUSEError(errno.EPERM)  # the size is the export's
        if fields.update_mode or fields.update_uid or fields.update_gid:
            raise pyfuse3.FUSEError(errno.EPERM)
        return current  # times: accepted, not kept

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = list(_ENTRIES.items())
        for index in range(start_id, len(entries)):
            name, inode = entries[index]
            if not pyfuse3.readdir_reply(token, name, self._attributes(inode), index + 1):
                break

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = (self.export.size + 4095) // 4096
        data.f_bfree = data.f_bavail = 0
        data.f_files = len(_ENTRIES) + 1
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    # -------------------------------------------------------------- files

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if inode == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if inode == DISK_INODE and writing and self.export.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode == REFRESH_INODE and not writing:
            raise pyfuse3.FUSEError(errno.EACCES)
        self._attributes(inode)  # ENOENT for anything else
        fh = self._next_fh
        self._next_fh += 1
        self._files[fh] = inode
        direct = self.direct_io or inode == REFRESH_INODE
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=not direct)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if self._inode(fh) != DISK_INODE:
            raise pyfuse3.FUSEError(errno.EBADF)
        count = max(0, min(size, self.export.size - off))
        if count == 0:
            return b""
        buffer = bytearray(count)
        await self._call(self.export.pread_into(buffer, off))
        return cast(bytes, buffer)  # pyfuse3 replies from any buffer: no copy

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        inode = self._inode(fh)
        if inode == REFRESH_INODE:
            await self.refresh()
            return len(buf)
        size = self.export.size
        if off >= size and buf:
            raise pyfuse3.FUSEError(errno.ENOSPC)
        data = buf if off + len(buf) <= size else memoryview(buf)[: size - off]
        await self._call(self.export.pwrite(data, off))
        self._written += 1
        return len(data)

    async def sync(self) -> None:
        """NBD FLUSH, unless every completed write is covered by one already."""
        covers = self._written
        if self._flushed >= covers:
            return
        await self._flush()
        self._flushed = max(self._flushed, covers)

    async def _flush(self) -> None:
        try:
            await self.export.flush()
        except ExportUnavailable as e:
            log.error("%s", e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except NBDError as e:
            log.warning("flush: %s", e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

    async def flush(self, fh: int) -> None:
        if self._inode(fh) == DISK_INODE:
            await self.sync()  # close() of a file that was written: make it durable

    async def fsync(self, fh: int, datasync: bool) -> None:
        if self._inode(fh) == DISK_INODE:
            await self.sync()

    async def release(self, fh: int) -> None:
        self._files.pop(fh, None)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE as NBD WRITE_ZEROES (not dispatched by pyfuse3
        3.5).  A punched hole must read back as zeroes, which NBD TRIM does not promise, so
        it is a WRITE_ZEROES the server may trim for; ZERO_RANGE keeps it allocated."""
        if self._inode(fh) != DISK_INODE:
            raise pyfuse3.FUSEError(errno.EBADF)
        size = self.export.size
        if mode & FALLOC_FL_PUNCH_HOLE:
            if not mode & FALLOC_FL_KEEP_SIZE:
                raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
            flags = 0
        elif mode & FALLOC_FL_ZERO_RANGE:
            flags = CmdFlag.NO_HOLE
        elif mode & ~FALLOC_FL_KEEP_SIZE == 0 and offset + length <= size:
            return  # plain allocation inside the export: the server's business
        else:
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        if self.export.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)
        if not self.export.can_zero:
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        end = min(offset + length, size)
        while offset < end:
            count = min(end - offset, ZERO_CHUNK)
            await self._call(self.export.zero(count, offset, flags))
            offset += count
        self._written += 1

    async def refresh(self) -> int:
        """Reconnect and re-read the export size; the kernel's cached size is dropped."""
        try:
            size = await self.export.refresh()
        except ExportUnavailable as e:
            log.error("refresh: %s", e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        with contextlib.suppress(OSError):  # ENOENT: the kernel never looked it up
            pyfuse3.invalidate_inode(DISK_INODE, attr_only=True)
        log.info("refreshed: export size %d", size)
        return size


# ------------------------------------------------------------------ running a mount


def set_io_flusher() -> bool:
    """``PR_SET_IO_FLUSHER`` for this process (before it starts threads: they inherit it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) == 0:
        return True
    code = ctypes.get_errno()
    log.warning(
        "PR_SET_IO_FLUSHER refused (%s): under memory pressure, reclaim may wait on the "
        "loop device this process serves",
        os.strerror(code),
    )
    return False


def mount_options(uri: str) -> set[str]:
    # fsname is a mount option: no commas or blanks; the query (TLS files) is left out
    shown = re.sub(r"[^A-Za-z0-9._:/@+\[\]-]", "_", uri.split("?", 1)[0])
    return {f"fsname={FSTYPE}:{shown}", f"subtype={FSTYPE}", "default_permissions"}


async def _serve(filesystem: BlockFile, ready: Callable[[], None] | None, early: EarlyStop) -> None:
    def terminating() -> None:
        if filesystem.open_files:
            log.warning("%d open file(s) lose the disk", filesystem.open_files)
        # requests waiting for a lost server fail now, those in flight within seconds
        filesystem.export.stop("the FUSE process is stopping")

    async def final_flush() -> None:
        with trio.move_on_after(FINAL_FLUSH_TIMEOUT):
            try:
                await filesystem.sync()
            except pyfuse3.FUSEError as e:
                log.error("the last flush failed: %s", os.strerror(e.errno))

    await run_fuse_loop(
        ready,
        early,
        on_terminate=terminating,
        after_unmount=final_flush,
        min_tasks=REQUEST_TASKS,
    )


def serve(
    uri: str,
    mountpoint: str | os.PathLike[str],
    *,
    connections: int = DEFAULT_CONNECTIONS,
    timeout: float = DEFAULT_IO_TIMEOUT,
    direct_io: bool = True,
    ready: Callable[[], None] | None = None,
) -> None:
    """Mount and serve in this process until unmounted or sent SIGTERM/SIGINT."""
    if not os.path.isdir(mountpoint):
        raise NotADirectoryError(errno.ENOTDIR, "mount point is not a directory", mountpoint)
    stop = EarlyStop()
    stop.install()
    set_io_flusher()
    export: ExportConnections | None = None
    try:
        export = ExportConnections.open(uri, connections, timeout=timeout)
        log.info(
            "%s: %d bytes, %d connection(s)%s",
            uri,
            export.size,
            len(export),
            ", read-only" if export.read_only else "",
        )
        if stop.signal is not None:
            return
        filesystem = BlockFile(export, direct_io=direct_io)
        pyfuse3.init(filesystem, os.fspath(mountpoint), mount_options(uri))
        raise_background_limit(mountpoint, BACKGROUND_LIMIT)
        try:
            trio.run(_serve, filesystem, ready, stop)
        finally:
            pyfuse3.close(unmount=True)
    finally:
        if export is not None:
            export.close()
        stop.restore()


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fuse.blockfile",
        description=f"Expose an NBD export as MOUNTPOINT/{DISK}; runs until unmounted.",
    )
    parser.add_argument("uri", help="nbd://HOST:PORT/EXPORT (any libnbd URI)")
    parser.add_argument("mountpoint")
    parser.add_argument("--connections", type=int, default=DEFAULT_CONNECTIONS)
    parser.add_argument("--ready-fd", type=int, help='write "ready" here, not to stdout')
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_IO_TIMEOUT,
        help="seconds a request waits for a server that went away, then EIO "
        f"(default {DEFAULT_IO_TIMEOUT:.0f})",
    )
    parser.add_argument("--no-direct-io", dest="direct_io", action="store_false")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.debug)
    signal_ = ReadySignal(args.ready_fd)

    try:
        if args.connections < 1:
            raise ValueError("--connections must be at least 1")
        if not 0 < args.timeout <= MAX_IO_TIMEOUT:
            raise ValueError(f"--timeout must be more than 0 and at most {MAX_IO_TIMEOUT:.0f}")
        serve(
            args.uri,
            args.mountpoint,
            connections=args.connections,
            timeout=args.timeout,
            direct_io=args.direct_io,
            ready=signal_.ready,
        )
    except (OSError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        signal_.failed(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One NBD export as one regular file, for a loop device on hosts without kernel NBD.

A FUSE filesystem with two files: ``disk``, whose bytes are the export's (its
size is the export's size), and ``refresh``, a control file: writing
anything to it reconnects to the server and re-reads the export size
(moorage's server and qemu-nbd read it at connect).  It runs in a process of
its own (``python -m fuse.blockfile NBD_URI MOUNTPOINT``) that lives as long
as the mount; :mod:`fuse.blockdev` puts a loop device on ``disk``.

Requests reach the server through :class:`fuse.nbdconnections.ExportConnections`
(multi-conn, many requests in flight, a hard mount over reconnects).

Choices, and why:

- **Our own request loop, not libfuse/pyfuse3.** A 4 KiB request through
  pyfuse3 cost ~140 µs of CPU (a trio task wake-up per request, a task
  switch per reply, libfuse's dispatch), so the process saturated a core at
  ~6,000 IOPS (docs/performance.md, section 6).  The block file needs a
  small part of the protocol (:mod:`fuse.fuseproto`), so it reads
  ``/dev/fuse`` itself, non-blocking, every request there is on each
  wake-up; a READ or WRITE goes to the NBD connection at once
  (``submit_pread`` of :mod:`nbd.pipeline` or :mod:`nbd.aio`), and its reply is written to
  ``/dev/fuse`` from its completion callback: no task and no event per
  request.  What is rare (flush, fsync, fallocate, refresh, a request that
  meets a lost connection) runs in a trio task through the awaitable
  methods of the export, which reconnect, fail over and bound the wait, as
  before.  Mounting is mount(2) with libfuse's options (:mod:`fuse.fusedev`).
  The NFS mount (:mod:`fuse.nfsmount`) stays on pyfuse3.
- **Our FUSE_INIT answer** sets ``max_background`` (:data:`BACKGROUND_LIMIT`
  asynchronous requests in flight; the kernel's default is 12),
  ``congestion_threshold``, ``max_pages`` (1 MiB requests) and asks for
  asynchronous direct I/O (a loop device's requests are many in flight).
- **direct_io.** ``disk`` is opened with ``FOPEN_DIRECT_IO`` and
  ``FOPEN_PARALLEL_DIRECT_WRITES`` (writes do not wait for each other on the
  inode lock), and the loop device is attached with ``LO_FLAGS_DIRECT_IO``.
  The filesystem on the loop device caches already; with neither flag the
  FUSE file's page cache holds every block a second time.  Either one alone
  keeps the second copy out, so both are set: the FUSE flag still holds
  when a loop device is attached buffered, and a size refresh never meets
  stale cached pages.
- **fallocate.** FUSE_FALLOCATE is served: ``PUNCH_HOLE|KEEP_SIZE`` (what a
  loop device sends for discard) and ``ZERO_RANGE`` become NBD
  WRITE_ZEROES (a punched hole must read back as zeroes, which NBD TRIM
  does not promise), plain allocation inside the export succeeds, anything
  that would change the size is EOPNOTSUPP.
- **More than one process.** The GIL bounds one process to one core.  With
  ``--workers N`` the mounting process starts N-1 more after FUSE_INIT, each
  with its own descriptor for the same connection (``FUSE_DEV_IOC_CLONE``)
  and its own NBD connections; the kernel gives each request to whichever
  reads first.  Multi-conn makes a FLUSH on any connection cover writes
  completed on all, so workers need it: without it at connect one process
  serves, and a reconnect that finds it withdrawn stops the workers
  (:func:`leave_when_single`).  A process cannot know what the others wrote,
  so with workers every FSYNC and FLUSH is an NBD FLUSH, and at unmount the
  mounting process flushes once its workers have ended.  A refresh in one
  process is announced to the others through a shared page
  (:class:`SharedSize`) and waits, bounded, until they have reconnected too;
  one that a live process did not follow fails with EIO.  A worker that dies
  is replaced; the requests it had taken fail (the kernel ends them with ECONNABORTED when its
  descriptor closes), none hangs.  A worker ends with its parent
  (``PR_SET_PDEATHSIG``).
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
import functools
import io
import logging
import mmap
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol, TypeVar

import trio

from fuse import fusedev
from fuse import fuseproto as fp
from fuse.nbdconnections import (
    CONNECT_TIMEOUT,
    DEFAULT_CONNECTIONS,
    DEFAULT_IO_TIMEOUT,
    MAX_IO_TIMEOUT,
    NBD_CLIENTS,
    Client,
    Connection,
    ExportConnections,
    ExportUnavailable,
    connect,
)
from fuse.process import ABANDON_AFTER, EarlyStop, ReadySignal, configure_logging
from nbd.libnbd import CmdFlag, NBDError

log = logging.getLogger("moorage.fuse.blockfile")

FSTYPE: Final = "moorage-nbd"  # /proc/mounts says fuse.moorage-nbd
DISK: Final = "disk"
REFRESH: Final = "refresh"
DISK_INODE: Final = 2
REFRESH_INODE: Final = 3
# Asynchronous FUSE requests the kernel keeps in flight (its default: 12).  A
# loop device with direct I/O queues many; each waits for a round trip.
BACKGROUND_LIMIT: Final = 64
MAX_PAGES: Final = 256  # 1 MiB requests
MAX_WRITE: Final = MAX_PAGES * 4096
READ_BUFFER: Final = MAX_WRITE + 4096  # a WRITE request: its header and its data
INIT_FLAGS: Final = fp.ASYNC_READ | fp.BIG_WRITES | fp.ASYNC_DIO | fp.MAX_PAGES
ATTR_TIMEOUT: Final = 1.0
FINAL_FLUSH_TIMEOUT: Final = 30.0
ZERO_CHUNK: Final = 1 << 30  # NBD lengths are 32 bits
PR_SET_PDEATHSIG: Final = 1
PR_SET_IO_FLUSHER: Final = 57
FALLOC_FL_KEEP_SIZE: Final = 0x01
FALLOC_FL_PUNCH_HOLE: Final = 0x02
FALLOC_FL_ZERO_RANGE: Final = 0x10
DEFAULT_WORKERS: Final = 1
MAX_WORKERS: Final = 16
WORKER_READY_TIMEOUT: Final = 30.0
# a worker's own graceful stop (requests under way, then its final flush), and some
WORKER_STOP_TIMEOUT: Final = ABANDON_AFTER + FINAL_FLUSH_TIMEOUT + 4.0
# past its bounded waits, the time a stopping process takes to unmount and exit
EXIT_MARGIN: Final = 5.0
WORKER_RESTART_MAX: Final = 5.0  # seconds between restarts of a worker that keeps dying
# a refresh waits this long for the other workers to reconnect
REFRESH_WAIT: Final = CONNECT_TIMEOUT + 5.0
REFRESH_TRIES: Final = 3  # a worker tries to follow a refresh this often, then gives up
REFRESH_RETRY_PAUSE: Final = 1.0  # seconds between those tries
SHARED_POLL: Final = 0.05  # seconds between a worker's looks at the shared page
FH_INODE_BITS: Final = 4  # a file handle: a serial number, then the inode
FH_INODE_MASK: Final = (1 << FH_INODE_BITS) - 1
_ENTRIES: Final = {DISK.encode(): DISK_INODE, REFRESH.encode(): REFRESH_INODE}

T = TypeVar("T")


class FuseError(Exception):
    """A request's answer: this errno."""

    def __init__(self, code: int) -> None:
        super().__init__(os.strerror(code))
        self.errno = code


# ------------------------------------------------------------------ shared between workers


class SharedSize:
    """A page shared by the processes that serve one mount: the generation of the last
    refresh, the export size it found, and what generation each worker has reached.

    Layout: ``u64 generation, u64 size, u64 acked[MAX_WORKERS], u64 single``;
    ``single`` is set once the server withdrew multi-conn: one process serves from
    then on (a FLUSH on one connection no longer covers writes made on another)."""

    _HEAD: Final = struct.Struct("=QQ")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, mmap.PAGESIZE)

    @classmethod
    def create(cls, size: int) -> SharedSize:
        fd = os.memfd_create("moorage-blockfile", 0)  # inheritable: for the workers
        os.ftruncate(fd, mmap.PAGESIZE)
        shared = cls(fd)
        shared.publish(0, size)
        return shared

    def read(self) -> tuple[int, int]:
        generation, size = self._HEAD.unpack_from(self._map, 0)
        return int(generation), int(size)

    def publish(self, generation: int, size: int) -> None:
        self._HEAD.pack_into(self._map, 0, generation, size)

    def ack(self, index: int, generation: int) -> None:
        struct.pack_into("=Q", self._map, 16 + 8 * index, generation)

    def acked(self, index: int) -> int:
        return int(struct.unpack_from("=Q", self._map, 16 + 8 * index)[0])

    _SINGLE: Final = 16 + 8 * MAX_WORKERS

    def make_single(self) -> None:
        struct.pack_into("=Q", self._map, self._SINGLE, 1)

    @property
    def single(self) -> bool:
        return bool(struct.unpack_from("=Q", self._map, self._SINGLE)[0])

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


# ------------------------------------------------------------------ the filesystem


class BlockFile:
    """``disk`` (the export) and ``refresh`` (write to re-read its size), served on one
    ``/dev/fuse`` descriptor (see the module docstring)."""

    def __init__(
        self,
        export: ExportConnections,
        *,
        direct_io: bool = True,
        attr_timeout: float = ATTR_TIMEOUT,
        write: Callable[[bytes | bytearray], object] | None = None,
    ) -> None:
        self.export = export
        self.direct_io = direct_io
        self.attr_timeout = attr_timeout
        self.uid, self.gid = os.geteuid(), os.getegid()
        self.mounted_ns = time.time_ns()  # constant times: a changed mtime drops caches
        self.fd = -1
        self._write = write if write is not None else self._write_fd
        self._files: dict[int, int] = {}  # fh -> inode
        self._next_fh = 1
        self._written = 0  # writes completed
        self._flushed = 0  # writes completed before the last FLUSH was sent
        self.initialized = False
        self.busy = 0  # requests taken and not answered yet
        self._idle: trio.Event | None = None
        self._later: Callable[[Callable[[], Awaitable[None]]], None] | None = None
        # set where more than one process serves the mount
        self.shared: SharedSize | None = None
        self.on_init: Callable[[], None] | None = None
        self.after_refresh: Callable[[int], Awaitable[None]] | None = None
        self._handlers: dict[int, Callable[[fp.Header, memoryview], None]] = {
            fp.INIT: self._init,
            fp.LOOKUP: self._lookup,
            fp.GETATTR: self._getattr,
            fp.SETATTR: self._setattr,
            fp.OPEN: self._open,
            fp.READ: self._read,
            fp.WRITE: self._write_request,
            fp.FLUSH: self._flush_request,
            fp.FSYNC: self._fsync_request,
            fp.RELEASE: self._release,
            fp.STATFS: self._statfs,
            fp.OPENDIR: self._opendir,
            fp.READDIR: self._readdir,
            fp.RELEASEDIR: self._empty,
            fp.FSYNCDIR: self._empty,
            fp.FALLOCATE: self._fallocate_request,
            fp.DESTROY: self._empty,
            fp.FORGET: self._nothing,
            fp.BATCH_FORGET: self._nothing,
            fp.INTERRUPT: self._nothing,  # requests are answered soon anyway
        }

    @property
    def open_files(self) -> int:
        """Files opened through this process and not released through it."""
        return len(self._files)

    # -------------------------------------------------------------- plumbing

    def _write_fd(self, data: bytes | bytearray) -> object:
        return os.write(self.fd, data)

    def _answer(self, data: bytes | bytearray) -> None:
        """Write one reply; the request it answers is done."""
        self.busy -= 1
        if self.busy == 0 and self._idle is not None:
            self._idle.set()
        try:
            self._write(data)
        except OSError as e:
            # ENOENT: the request was interrupted or aborted; ENODEV: unmounted
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("a FUSE reply was refused: %s", e)

    def _fail(self, unique: int, code: int) -> None:
        self._answer(fp.error_reply(unique, code))

    def _spawn(self, unique: int, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` (which answers ``unique``) in a task of its own."""
        if self._later is None:
            self._fail(unique, errno.EIO)  # not serving (a unit test without a loop)
            return

        async def run() -> None:
            try:
                await work()
            except FuseError as e:
                self._fail(unique, e.errno)
            except Exception:
                log.exception("unexpected error in a FUSE request")
                self._fail(unique, errno.EIO)

        try:
            self._later(run)
        except RuntimeError as e:  # the nursery is closed: the loop is ending
            log.warning("a FUSE request could not be served: %s", e)
            self._fail(unique, errno.EIO)

    async def _call(self, request: Awaitable[T]) -> T:
        try:
            return await request
        except ExportUnavailable as e:
            log.error("%s", e)
            raise FuseError(errno.EIO) from None
        except NBDError as e:
            log.warning("%s", e)
            raise FuseError(e.errno or errno.EIO) from None
        except FuseError:
            raise
        except Exception:
            log.exception("unexpected error in an NBD call")
            raise FuseError(errno.EIO) from None

    @property
    def size(self) -> int:
        return self.export.size

    def _attributes(self, inode: int) -> fp.Attr:
        if inode == fp.ROOT_ID:
            return fp.Attr(inode, 0, stat.S_IFDIR | 0o755, 2, self.uid, self.gid, self.mounted_ns)
        if inode == DISK_INODE:
            mode = stat.S_IFREG | (0o400 if self.export.read_only else 0o600)
            return fp.Attr(inode, self.size, mode, 1, self.uid, self.gid, self.mounted_ns)
        if inode == REFRESH_INODE:
            return fp.Attr(inode, 0, stat.S_IFREG | 0o200, 1, self.uid, self.gid, self.mounted_ns)
        raise FuseError(errno.ENOENT)

    def _inode(self, fh: int) -> int:
        """The inode a file handle was opened on: the handle carries it, so any process
        serving the mount knows it, whichever answered the OPEN."""
        inode = fh & FH_INODE_MASK
        if fh <= FH_INODE_MASK or inode not in (DISK_INODE, REFRESH_INODE):
            raise FuseError(errno.EBADF)
        return inode

    # -------------------------------------------------------------- dispatch

    def handle(self, buf: bytes | bytearray | memoryview, count: int) -> None:
        """One request of ``count`` bytes at the start of ``buf``: answered now, or later
        by a completion callback or a task.  Never raises: a request that cannot be
        taken gets an error reply (one without a whole header cannot be answered)."""
        view = memoryview(buf)[:count]
        try:
            header = fp.parse_header(view, count)
        except fp.Malformed as e:
            log.warning("malformed FUSE request: %s", e)
            if count >= fp.IN_HEADER.size:
                unique = fp.IN_HEADER.unpack_from(view)[2]
                self.busy += 1
                self._fail(unique, e.errno)
            return
        opcode = header.opcode
        replies = opcode not in fp.NO_REPLY
        if replies:
            self.busy += 1
        handler = self._handlers.get(opcode)
        try:
            if handler is None:
                raise FuseError(errno.ENOSYS)
            if not self.initialized and opcode != fp.INIT:
                raise FuseError(errno.EIO)
            handler(header, view[fp.IN_HEADER.size :])
        except FuseError as e:
            if replies:
                self._fail(header.unique, e.errno)
        except fp.Malformed as e:
            log.warning("malformed FUSE request: %s", e)
            if replies:
                self._fail(header.unique, e.errno)
        except Exception:
            log.exception("unexpected error in FUSE request %d (opcode %d)", header.unique, opcode)
            if replies:
                self._fail(header.unique, errno.EIO)

    def _nothing(self, header: fp.Header, body: memoryview) -> None:
        pass

    def _empty(self, header: fp.Header, body: memoryview) -> None:
        self._answer(fp.reply(header.unique))

    # -------------------------------------------------------------- names

    def _init(self, header: fp.Header, body: memoryview) -> None:
        major, minor, max_readahead, flags = fp.INIT_IN.unpack_from(body)
        if major < fp.KERNEL_VERSION:
            raise FuseError(errno.EPROTO)
        if self.initialized:
            raise FuseError(errno.EIO)
        self.initialized = True
        out = fp.init_out(
            minor,
            flags,
            max_readahead,
            wanted=INIT_FLAGS,
            max_background=BACKGROUND_LIMIT,
            congestion_threshold=BACKGROUND_LIMIT * 3 // 4,
            max_write=MAX_WRITE,
            max_pages=MAX_PAGES,
        )
        self._answer(fp.reply(header.unique, out))
        log.debug("FUSE %d.%d, flags %#x", major, minor, flags)
        if self.on_init is not None:
            self.on_init()

    def _lookup(self, header: fp.Header, body: memoryview) -> None:
        name = fp.name_of(body)
        if header.nodeid != fp.ROOT_ID:
            raise FuseError(errno.ENOTDIR)
        inode = fp.ROOT_ID if name in (b".", b"..") else _ENTRIES.get(name)
        if inode is None:
            raise FuseError(errno.ENOENT)
        out = fp.entry_out(self._attributes(inode), self.attr_timeout)
        self._answer(fp.reply(header.unique, out))

    def _getattr(self, header: fp.Header, body: memoryview) -> None:
        out = fp.attr_out(self._attributes(header.nodeid), self.attr_timeout)
        self._answer(fp.reply(header.unique, out))

    def _setattr(self, header: fp.Header, body: memoryview) -> None:
        valid, _, _, size = fp.SETATTR_IN.unpack_from(body)[:4]
        current = self._attributes(header.nodeid)
        if valid & fp.FATTR_SIZE and size != current.size and header.nodeid != REFRESH_INODE:
            raise FuseError(errno.EPERM)  # the size is the export's
        if valid & (fp.FATTR_MODE | fp.FATTR_UID | fp.FATTR_GID):
            raise FuseError(errno.EPERM)
        # times: accepted, not kept
        self._answer(fp.reply(header.unique, fp.attr_out(current, self.attr_timeout)))

    def _opendir(self, header: fp.Header, body: memoryview) -> None:
        if header.nodeid != fp.ROOT_ID:
            raise FuseError(errno.ENOTDIR)
        self._answer(fp.reply(header.unique, fp.OPEN_OUT.pack(0, 0, 0)))

    def _readdir(self, header: fp.Header, body: memoryview) -> None:
        _, offset, size = fp.READ_IN.unpack_from(body)[:3]
        out = bytearray()
        entries = list(_ENTRIES.items())
        for index in range(offset, len(entries)):
            name, inode = entries[index]
            record = fp.dirent(inode, index + 1, name, fp.DT_REG)
            if len(out) + len(record) > size:
                break
            out += record
        self._answer(fp.reply(header.unique, out))

    def _statfs(self, header: fp.Header, body: memoryview) -> None:
        out = fp.statfs_out((self.size + 4095) // 4096, len(_ENTRIES) + 1)
        self._answer(fp.reply(header.unique, out))

    # -------------------------------------------------------------- files

    def _open(self, header: fp.Header, body: memoryview) -> None:
        flags = fp.OPEN_IN.unpack_from(body)[0]
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        inode = header.nodeid
        if inode == fp.ROOT_ID:
            raise FuseError(errno.EISDIR)
        if inode == DISK_INODE and writing and self.export.read_only:
            raise FuseError(errno.EROFS)
        if inode == REFRESH_INODE and not writing:
            raise FuseError(errno.EACCES)
        self._attributes(inode)  # ENOENT for anything else
        fh = self._next_fh << FH_INODE_BITS | inode
        self._next_fh += 1
        self._files[fh] = inode
        if self.direct_io or inode == REFRESH_INODE:
            open_flags = fp.FOPEN_DIRECT_IO | fp.FOPEN_PARALLEL_DIRECT_WRITES
        else:
            open_flags = fp.FOPEN_KEEP_CACHE
        self._answer(fp.reply(header.unique, fp.OPEN_OUT.pack(fh, open_flags, 0)))

    def _release(self, header: fp.Header, body: memoryview) -> None:
        fh = fp.RELEASE_IN.unpack_from(body)[0]
        self._files.pop(fh, None)
        self._answer(fp.reply(header.unique))

    def _read(self, header: fp.Header, body: memoryview) -> None:
        fh, offset, size = fp.READ_IN.unpack_from(body)[:3]
        if self._inode(fh) != DISK_INODE:
            raise FuseError(errno.EBADF)
        unique = header.unique
        count = max(0, min(size, self.size - offset))
        if count == 0:
            self._answer(fp.reply(unique))
            return
        # the reply's header and data in one buffer: one write(2) answers it
        out = bytearray(fp.OUT_HEADER.size + count)
        fp.OUT_HEADER.pack_into(out, 0, len(out), 0, unique)
        conn = self.export.ready_connection()
        if conn is not None:
            target = (ctypes.c_char * count).from_buffer(out, fp.OUT_HEADER.size)

            def done(error: int) -> None:
                if error == 0:
                    self._answer(out)
                else:
                    self._failed(unique, conn, error, "read", lambda c: c.pread_into(data, offset))

            data = memoryview(out)[fp.OUT_HEADER.size :]
            try:
                conn.submit_pread(target, count, offset, done)
            except NBDError as e:
                done(e.errno or errno.EIO)
            return
        view = memoryview(out)[fp.OUT_HEADER.size :]

        async def slowly() -> None:
            await self._call(self.export.pread_into(view, offset))
            self._answer(out)

        self._spawn(unique, slowly)

    def _failed(
        self,
        unique: int,
        conn: Connection,
        error: int,
        what: str,
        again: Callable[[Connection], Awaitable[None]],
        then: Callable[[], None] | None = None,
    ) -> None:
        """A request sent without a task failed: the server's answer is passed on, a
        lost connection sends it again in a task (reconnects, failover, the bound)."""
        if self.export.answer_of(conn, error):
            log.warning("%s: %s", what, os.strerror(error))
            self._fail(unique, error)
            return

        async def again_() -> None:
            await self._call(self.export.resubmit(conn, error, again))
            if then is not None:
                then()

        self._spawn(unique, again_)

    def _write_request(self, header: fp.Header, body: memoryview) -> None:
        fh, offset, size = fp.WRITE_IN.unpack_from(body)[:3]
        payload = body[fp.WRITE_IN.size :]
        if len(payload) != size:
            raise fp.Malformed(f"WRITE of {size} bytes carries {len(payload)}")
        inode = self._inode(fh)
        unique = header.unique
        if inode == REFRESH_INODE:

            async def refresh() -> None:
                await self.refresh()
                self._answer(fp.reply(unique, fp.WRITE_OUT.pack(size, 0)))

            self._spawn(unique, refresh)
            return
        if inode != DISK_INODE:
            raise FuseError(errno.EBADF)
        export_size = self.size
        if offset >= export_size and size:
            raise FuseError(errno.ENOSPC)
        count = min(size, export_size - offset)
        data = bytes(payload[:count])  # the read buffer is reused for the next request
        answer = fp.reply(unique, fp.WRITE_OUT.pack(count, 0))

        def written() -> None:
            self._written += 1
            self._answer(answer)

        conn = self.export.ready_connection()
        if conn is not None:

            def done(error: int) -> None:
                if error == 0:
                    written()
                else:
                    self._failed(
                        unique, conn, error, "write", lambda c: c.pwrite(data, offset), written
                    )

            try:
                conn.submit_pwrite(data, offset, done)
            except NBDError as e:
                done(e.errno or errno.EIO)
            return

        async def slowly() -> None:
            await self._call(self.export.pwrite(data, offset))
            written()

        self._spawn(unique, slowly)

    def _flush_request(self, header: fp.Header, body: memoryview) -> None:
        # close() of a file that was written: make it durable
        self._sync_request(header, fp.FLUSH_IN.unpack_from(body)[0])

    def _fsync_request(self, header: fp.Header, body: memoryview) -> None:
        self._sync_request(header, fp.FSYNC_IN.unpack_from(body)[0])

    def _sync_request(self, header: fp.Header, fh: int) -> None:
        unique = header.unique
        if self._inode(fh) != DISK_INODE or self._covered():
            self._answer(fp.reply(unique))
            return

        async def sync() -> None:
            await self.sync()
            self._answer(fp.reply(unique))

        self._spawn(unique, sync)

    def _covered(self) -> bool:
        """Whether every completed write is covered by a FLUSH already.  Known only
        where one process serves the mount: with workers, the kernel may give the
        writes to one process and the FSYNC to another, so a FLUSH is always sent."""
        return self.shared is None and self._flushed >= self._written

    async def sync(self) -> None:
        """NBD FLUSH, unless every completed write is covered by one already."""
        covers = self._written
        if self._covered():
            return
        try:
            await self.export.flush()
        except ExportUnavailable as e:
            log.error("%s", e)
            raise FuseError(errno.EIO) from None
        except NBDError as e:
            log.warning("flush: %s", e)
            raise FuseError(e.errno or errno.EIO) from None
        self._flushed = max(self._flushed, covers)

    def _fallocate_request(self, header: fp.Header, body: memoryview) -> None:
        fh, offset, length, mode = fp.FALLOCATE_IN.unpack_from(body)[:4]
        unique = header.unique

        async def fallocate() -> None:
            await self.fallocate(fh, mode, offset, length)
            self._answer(fp.reply(unique))

        self._spawn(unique, fallocate)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE as NBD WRITE_ZEROES.  A punched hole must
        read back as zeroes, which NBD TRIM does not promise, so it is a WRITE_ZEROES the
        server may trim for; ZERO_RANGE keeps it allocated."""
        if self._inode(fh) != DISK_INODE:
            raise FuseError(errno.EBADF)
        size = self.size
        if mode & FALLOC_FL_PUNCH_HOLE:
            if not mode & FALLOC_FL_KEEP_SIZE:
                raise FuseError(errno.EOPNOTSUPP)
            flags = 0
        elif mode & FALLOC_FL_ZERO_RANGE:
            flags = CmdFlag.NO_HOLE
        elif mode & ~FALLOC_FL_KEEP_SIZE == 0 and offset + length <= size:
            return  # plain allocation inside the export: the server's business
        else:
            raise FuseError(errno.EOPNOTSUPP)
        if self.export.read_only:
            raise FuseError(errno.EROFS)
        if not self.export.can_zero:
            raise FuseError(errno.EOPNOTSUPP)
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
            raise FuseError(errno.EIO) from None
        try:
            if self.after_refresh is not None:
                await self.after_refresh(size)
        finally:
            self.invalidate_size()
        log.info("refreshed: export size %d", size)
        return size

    def invalidate_size(self) -> None:
        with contextlib.suppress(OSError):  # ENOENT: the kernel never looked it up
            self._write(fp.notify_inval_inode(DISK_INODE))

    # -------------------------------------------------------------- the loop

    async def run(self, fd: int, later: Callable[[Callable[[], Awaitable[None]]], None]) -> None:
        """Serve ``fd`` until the mount goes away (or this is cancelled)."""
        self.fd = fd
        self._later = later
        device = io.FileIO(fd, "rb", closefd=False)
        buf = bytearray(READ_BUFFER)
        handle = self.handle
        readinto = device.readinto
        while True:
            await trio.lowlevel.wait_readable(fd)
            while True:
                try:
                    count = readinto(buf)
                except OSError as e:
                    if e.errno == errno.ENODEV:
                        log.info("unmounted")
                        return
                    if e.errno in (errno.ENOENT, errno.EINTR):
                        continue  # a request interrupted before it was read
                    raise
                if count is None:
                    break  # EAGAIN: until the next wake-up
                handle(buf, count)

    async def wait_idle(self) -> None:
        """Until every request taken has been answered."""
        while self.busy > 0:
            self._idle = trio.Event()
            await self._idle.wait()


# ------------------------------------------------------------------ workers


class Workers:
    """The other processes serving the mount (``--workers``), started once FUSE_INIT is
    answered, replaced when they die, stopped with the mount."""

    def __init__(self, argv: list[str], fd: int, count: int, shared: SharedSize) -> None:
        self._argv = argv  # the worker's command line, without the descriptor options
        self._fd = fd
        self.count = count
        self.shared = shared
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def start(self, index: int) -> subprocess.Popen[bytes]:
        clone = fusedev.clone(self._fd)
        try:
            argv = [*self._argv, "--worker", f"{index},{clone},{self.shared.fd},{os.getpid()}"]
            proc = subprocess.Popen(
                argv,
                pass_fds=(clone, self.shared.fd),
                stdin=subprocess.DEVNULL,
                cwd="/",
            )
        finally:
            os.close(clone)  # the worker holds it now
        self.procs[index] = proc
        log.info("worker %d started (pid %d)", index, proc.pid)
        return proc

    async def watch(self, index: int) -> None:
        """Keep worker ``index`` running until the mount stops."""
        last_start = 0.0
        while not self.stopping:
            if self.shared.single:
                return  # multi-conn withdrawn: the worker stops itself, none replaces it
            proc = self.procs.get(index)
            if proc is None or proc.poll() is not None:
                pause = WORKER_RESTART_MAX - (trio.current_time() - last_start)
                if last_start and pause > 0:
                    await trio.sleep(pause)
                if self.stopping:
                    return
                last_start = trio.current_time()
                try:
                    proc = self.start(index)
                except OSError as e:
                    log.error("worker %d could not start: %s", index, e)
                    continue
            await trio.sleep(0.2)  # bounded by its poll: a dead worker is seen promptly
            if proc.poll() is not None and not self.stopping:
                log.warning(
                    "worker %d (pid %d) exited with %s: the requests it had taken failed; "
                    "starting another",
                    index,
                    proc.pid,
                    proc.returncode,
                )

    def alive(self, index: int) -> bool:
        proc = self.procs.get(index)
        return proc is not None and proc.poll() is None

    def stop(self) -> None:
        """SIGTERM each worker, once: a second SIGTERM would make it abandon the
        requests under way and its final flush."""
        if self.stopping:
            return
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    async def ended(self, timeout: float) -> None:
        """Wait (in trio) for the workers to end, SIGKILL after ``timeout`` seconds."""
        with trio.move_on_after(timeout):
            while any(proc.poll() is None for proc in self.procs.values()):
                await trio.sleep(SHARED_POLL)
        self.reap(0.0)

    def reap(self, timeout: float) -> None:
        """Wait for the workers to end (SIGKILL after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        for index, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d (pid %d) did not stop: killed", index, proc.pid)
                proc.kill()
                proc.wait()


async def announce_refresh(
    shared: SharedSize,
    index: int,
    count: int,
    size: int,
    alive: Callable[[int], bool],
    wait: float = REFRESH_WAIT,
) -> None:
    """Process ``index`` found the export's new ``size``: tell the others, and wait
    (at most ``wait`` seconds) until each has reconnected too, so that no request
    past the old size reaches one that still has it.  :class:`FuseError` (EIO) when
    a live process has not acknowledged it by then: the refresh is not complete."""
    generation = shared.read()[0] + 1
    shared.publish(generation, size)
    shared.ack(index, generation)
    deadline = trio.current_time() + wait
    for other in range(count):
        while other != index and shared.acked(other) < generation and alive(other):
            if trio.current_time() > deadline:
                log.error("refresh: process %d did not reconnect within %.0fs", other, wait)
                raise FuseError(errno.EIO)
            await trio.sleep(SHARED_POLL / 2)


async def follow_refreshes(filesystem: BlockFile, shared: SharedSize, index: int) -> None:
    """A refresh made by another process serving the mount: reconnect too, then ack
    (only once reconnected: a refresh that failed is tried :data:`REFRESH_TRIES`
    times, then left unacknowledged, so that the announcing process fails it)."""
    seen = -1  # a refresh announced while this process was connecting counts too
    while True:
        generation, size = shared.read()
        if generation == seen:
            await trio.sleep(SHARED_POLL)
            continue
        seen = generation
        if size != filesystem.export.size and not await _follow(filesystem, generation):
            continue
        shared.ack(index, generation)


async def _follow(filesystem: BlockFile, generation: int) -> bool:
    """Reconnect for refresh ``generation``; whether it worked."""
    for attempt in range(1, REFRESH_TRIES + 1):
        try:
            await filesystem.export.refresh()
        except ExportUnavailable as e:
            log.error("refresh %d (try %d of %d): %s", generation, attempt, REFRESH_TRIES, e)
            if attempt < REFRESH_TRIES:
                await trio.sleep(REFRESH_RETRY_PAUSE)
            continue
        filesystem.invalidate_size()
        return True
    return False


async def leave_when_single(shared: SharedSize, index: int) -> None:
    """In a worker: once multi-conn is withdrawn (by the server, seen by any process),
    stop as on SIGTERM (requests under way answered, a last flush); the mounting
    process serves alone from then on and starts no other worker."""
    while not shared.single:
        await trio.sleep(SHARED_POLL)
    log.warning("worker %d: multi-conn withdrawn: stopping, one process serves", index)
    os.kill(os.getpid(), signal.SIGTERM)


# ------------------------------------------------------------------ running a mount


def set_io_flusher() -> bool:
    """``PR_SET_IO_FLUSHER`` for this process (before it starts threads: they inherit it)."""
    if _prctl(PR_SET_IO_FLUSHER, 1) == 0:
        return True
    code = ctypes.get_errno()
    log.warning(
        "PR_SET_IO_FLUSHER refused (%s): under memory pressure, reclaim may wait on the "
        "loop device this process serves",
        os.strerror(code),
    )
    return False


def _prctl(option: int, value: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return int(prctl(option, value, 0, 0, 0))


def fsname(uri: str) -> str:
    # fsname is a mount option: no commas or blanks; the query (TLS files) is left out
    shown = re.sub(r"[^A-Za-z0-9._:/@+\[\]-]", "_", uri.split("?", 1)[0])
    return f"{FSTYPE}:{shown}"


def mount_options(uri: str) -> set[str]:
    """The options a mount shows (as pyfuse3 was given them)."""
    return {f"fsname={fsname(uri)}", f"subtype={FSTYPE}", "default_permissions"}


async def _serve(
    filesystem: BlockFile,
    fd: int,
    ready: Callable[[], None] | None,
    early: EarlyStop,
    *,
    workers: Workers | None = None,
    abandon_after: float = ABANDON_AFTER,
) -> None:
    """Serve ``fd`` until unmounted or told to stop (SIGTERM/SIGINT: requests under way
    are answered, for at most ``abandon_after`` seconds; a second signal: at once)."""
    terminating = trio.Event()

    async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if not terminating.is_set():
                    if filesystem.open_files and filesystem.shared is None:
                        log.warning("%d open file(s) lose the disk", filesystem.open_files)
                    if workers is not None:
                        workers.stop()
                    # requests waiting for a lost server fail now, those in flight within seconds
                    filesystem.export.stop("the FUSE process is stopping")
                    log.info("%s: unmounting", signal.Signals(signum).name)
                    terminating.set()
                    reading.cancel()
                else:
                    log.warning("%s again: abandoning requests under way", signum)
                    nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        await nursery.start(stop_on_signal)
        if early.signal is not None:
            log.info("%s before the FUSE loop started: unmounting", early.signal)
            nursery.cancel_scope.cancel()
            return
        if workers is not None:

            def start_workers() -> None:
                for index in range(1, workers.count):
                    nursery.start_soon(workers.watch, index)

            async def refreshed(size: int) -> None:
                await announce_refresh(workers.shared, 0, workers.count, size, workers.alive)

            filesystem.on_init = start_workers
            filesystem.after_refresh = refreshed
            nursery.start_soon(follow_refreshes, filesystem, workers.shared, 0)
        if ready is not None:
            ready()
        with trio.CancelScope() as reading:
            await filesystem.run(fd, nursery.start_soon)
        if terminating.is_set():
            with trio.move_on_after(abandon_after) as waited:
                await filesystem.wait_idle()
            if waited.cancelled_caught:
                log.warning(
                    "requests still under way %.0fs after the signal: abandoned", abandon_after
                )
        if workers is not None:
            # the workers flush on their way out; the flush below comes after theirs,
            # and covers whatever any process wrote (filesystem.shared is set)
            workers.stop()
            await workers.ended(WORKER_STOP_TIMEOUT)
        # once stopped, the export sends this FLUSH on a connection still alive or on
        # one made for it, whatever the stop closed
        with trio.move_on_after(FINAL_FLUSH_TIMEOUT) as flushing:
            try:
                await filesystem.sync()
            except FuseError as e:
                log.error("the last flush failed: %s", os.strerror(e.errno))
        if flushing.cancelled_caught:
            log.error("the last flush was not answered within %.0fs", FINAL_FLUSH_TIMEOUT)
        nursery.cancel_scope.cancel()


class Ready(Protocol):
    """What :func:`serve` calls once the mount is in place, with what the starter
    needs to know (:meth:`fuse.process.ReadySignal.ready` passes it on)."""

    def __call__(self, *, minimum_block_size: int) -> None: ...


def serve(
    uri: str,
    mountpoint: str | os.PathLike[str],
    *,
    connections: int = DEFAULT_CONNECTIONS,
    timeout: float = DEFAULT_IO_TIMEOUT,
    direct_io: bool = True,
    workers: int = DEFAULT_WORKERS,
    ready: Ready | None = None,
    nbd_client: str = "auto",
) -> None:
    """Mount and serve in this process (and ``workers - 1`` more) until unmounted or
    sent SIGTERM/SIGINT.  ``nbd_client``: one of :data:`NBD_CLIENTS` (see
    :func:`fuse.nbdconnections.connect`).  ``ready`` is called once the mount is
    in place, with the export's ``minimum_block_size`` (the loop device's
    logical block size is derived from it: :func:`fuse.blockdev.loop_block_size`)."""
    if not os.path.isdir(mountpoint):
        raise NotADirectoryError(errno.ENOTDIR, "mount point is not a directory", mountpoint)
    stop = EarlyStop()
    stop.install()
    set_io_flusher()
    export: ExportConnections | None = None
    shared: SharedSize | None = None
    team: Workers | None = None
    try:
        export = ExportConnections.open(
            uri, _share(connections, workers), timeout=timeout, connect=_connector(nbd_client)
        )
        log.info(
            "%s: %d bytes, %d connection(s)%s%s",
            uri,
            export.size,
            len(export),
            ", read-only" if export.read_only else "",
            f", {workers} processes" if workers > 1 else "",
        )
        if stop.signal is not None:
            return
        if workers > 1 and not export.multi_conn:
            # a FLUSH on one process's connection would not cover another's writes
            log.warning("%s does not advertise multi-conn: one process serves", uri)
            workers = 1
        filesystem = BlockFile(export, direct_io=direct_io)
        fd = fusedev.mount(mountpoint, fsname(uri), FSTYPE, ["default_permissions"])
        try:
            if workers > 1:
                shared = SharedSize.create(export.size)
                argv = [sys.executable, "-m", "fuse.blockfile", uri, os.fspath(mountpoint)]
                argv += ["--connections", str(connections), "--timeout", str(timeout)]
                argv += ["--workers", str(workers), "--nbd-client", nbd_client]
                if not direct_io:
                    argv.append("--no-direct-io")
                team = Workers(argv, fd, workers, shared)
                filesystem.shared = shared
                export.on_multi_conn_withdrawn = shared.make_single
            told = (
                None
                if ready is None
                else functools.partial(ready, minimum_block_size=export.minimum_block_size)
            )
            trio.run(functools.partial(_serve, filesystem, fd, told, stop, workers=team))
        finally:
            if team is not None:
                team.stop()
                team.reap(WORKER_STOP_TIMEOUT)
            fusedev.unmount(mountpoint)
            os.close(fd)
    finally:
        if export is not None:
            export.close()
        if shared is not None:
            shared.close()
        stop.restore()


def stop_bound(workers: int) -> float:
    """The longest a block-file process started with ``workers`` processes takes
    to exit after one SIGTERM, by its own bounds: the requests under way
    (``ABANDON_AFTER``), the other workers' stops (``WORKER_STOP_TIMEOUT``, each
    SIGKILLed past it), the final flush (``FINAL_FLUSH_TIMEOUT``), then unmount
    and exit (``EXIT_MARGIN``).  Whoever stops it waits this long before SIGKILL,
    so a process that is still flushing what it acknowledged is never killed."""
    bound = ABANDON_AFTER + FINAL_FLUSH_TIMEOUT + EXIT_MARGIN
    if workers > 1:
        bound += WORKER_STOP_TIMEOUT
    return bound


def _connector(nbd_client: str) -> Callable[[str], Client]:
    """How this process connects: :func:`fuse.nbdconnections.connect` with ``nbd_client``."""
    if nbd_client not in NBD_CLIENTS:
        raise ValueError(
            f"--nbd-client must be one of {', '.join(NBD_CLIENTS)}, not {nbd_client!r}"
        )
    return functools.partial(connect, client=nbd_client)


def _share(connections: int, workers: int) -> int:
    """NBD connections of each process: the total shared out, at least one each."""
    return max(1, connections // max(1, workers))


def serve_worker(
    uri: str,
    worker: str,
    *,
    connections: int,
    workers: int,
    timeout: float,
    direct_io: bool,
    nbd_client: str = "auto",
) -> None:
    """A worker process: serve the cloned descriptor until the mount or the parent goes."""
    index_text, fd_text, shared_text, parent_text = worker.split(",")
    index, fd, parent = int(index_text), int(fd_text), int(parent_text)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        raise RuntimeError("the mounting process is gone")
    os.set_inheritable(fd, False)
    stop = EarlyStop()
    stop.install()
    set_io_flusher()
    shared = SharedSize(int(shared_text))
    export: ExportConnections | None = None
    try:
        export = ExportConnections.open(
            uri, _share(connections, workers), timeout=timeout, connect=_connector(nbd_client)
        )
        if export.size != shared.read()[1]:
            log.info("worker %d: export size %d", index, export.size)
        if not export.multi_conn:
            shared.make_single()
            raise RuntimeError("the server no longer advertises multi-conn: not serving")
        filesystem = BlockFile(export, direct_io=direct_io)
        filesystem.shared = shared
        filesystem.initialized = True  # the mounting process answered FUSE_INIT
        export.on_multi_conn_withdrawn = shared.make_single

        async def refreshed(size: int) -> None:
            await announce_refresh(shared, index, workers, size, lambda _: True)

        filesystem.after_refresh = refreshed

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow_refreshes, filesystem, shared, index)
                nursery.start_soon(leave_when_single, shared, index)
                log.info("serving, %d connection(s)", len(export))
                await _serve(filesystem, fd, None, stop)
                nursery.cancel_scope.cancel()

        trio.run(run)
    finally:
        os.close(fd)
        if export is not None:
            export.close()
        shared.close()
        stop.restore()


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fuse.blockfile",
        description=f"Expose an NBD export as MOUNTPOINT/{DISK}; runs until unmounted.",
    )
    parser.add_argument("uri", help="nbd://HOST:PORT/EXPORT (any libnbd URI)")
    parser.add_argument("mountpoint")
    parser.add_argument(
        "--connections",
        type=int,
        default=DEFAULT_CONNECTIONS,
        help="NBD connections in all (shared out among the processes)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"processes serving the mount (default {DEFAULT_WORKERS})",
    )
    parser.add_argument("--ready-fd", type=int, help='write "ready" here, not to stdout')
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_IO_TIMEOUT,
        help="seconds a request waits for a server that went away, then EIO "
        f"(default {DEFAULT_IO_TIMEOUT:.0f})",
    )
    parser.add_argument("--no-direct-io", dest="direct_io", action="store_false")
    parser.add_argument(
        "--nbd-client",
        choices=NBD_CLIENTS,
        default="auto",
        help="the NBD client of every connection: auto (moorage's pipelined client on "
        "nbd:// and nbd+unix://, libnbd for TLS) or libnbd (libnbd always, to compare; "
        "default auto)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # index,fd,shared fd,parent pid
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    if args.worker is not None:
        configure_logging(args.debug, f"worker {args.worker.split(',')[0]}")
        try:
            serve_worker(
                args.uri,
                args.worker,
                connections=args.connections,
                workers=args.workers,
                timeout=args.timeout,
                direct_io=args.direct_io,
                nbd_client=args.nbd_client,
            )
        except (OSError, ValueError, RuntimeError) as e:
            log.error("worker: %s", e)
            return 1
        return 0
    configure_logging(args.debug)
    signal_ = ReadySignal(args.ready_fd)

    try:
        if args.connections < 1:
            raise ValueError("--connections must be at least 1")
        if not 1 <= args.workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be from 1 to {MAX_WORKERS}")
        if not 0 < args.timeout <= MAX_IO_TIMEOUT:
            raise ValueError(f"--timeout must be more than 0 and at most {MAX_IO_TIMEOUT:.0f}")
        serve(
            args.uri,
            args.mountpoint,
            connections=args.connections,
            timeout=args.timeout,
            direct_io=args.direct_io,
            workers=args.workers,
            ready=signal_.ready,
            nbd_client=args.nbd_client,
        )
    except (OSError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        signal_.failed(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

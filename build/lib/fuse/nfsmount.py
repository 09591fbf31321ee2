"""One NFSv3 export mounted on a directory through libnfs and FUSE.

For hosts without a kernel NFS client.  :class:`NFSFilesystem` is a pyfuse3
filesystem whose every request becomes libnfs calls on the export; it runs in
a process of its own (``python -m fuse.nfsmount SERVER:PORT:/PATH MOUNTPOINT``)
that lives as long as the mount.

Choices, and why:

- **Paths, not handles.** libnfs 4.0.0's synchronous API is path based, so
  each inode the kernel knows maps to the path it was last seen at, counted
  by lookups and dropped at ``forget``.  Inode numbers are the server's
  fileids (the export root's swapped with FUSE's root, 1).  A path found to
  hold another object (renamed by another client) answers ``ESTALE``, which
  makes the kernel look the name up again.
- **A pool of contexts.** A libnfs context is not thread-safe.  The
  filesystem owns a few mounted contexts; a request borrows one, runs its
  blocking calls in a worker thread, and gives it back, so at most that many
  calls are in flight and the FUSE loop never blocks.  Open files are NFSv3
  file handles, valid on every context.
- **Permissions are checked by the kernel** (``default_permissions``): every
  call reaches the server with this process's AUTH_SYS credentials (root, on
  an export with ``no_root_squash``), and NFSv3 owners are numeric, so the
  owner and mode the server reports are the ones to check against.  A file a
  non-root caller creates is given to that caller with a ``chown``.
- **Close-to-open consistency.** Attribute and entry timeouts are short
  (``cache_timeout``), the page cache is dropped at every open, writes go
  through (no writeback cache), and ``flush`` commits a handle that was
  written, as an NFS client does at close.
- **Read-ahead.** The kernel's read-ahead on the mount is raised to
  1 MiB once FUSE_INIT is answered (pyfuse3 answers 128 KiB, and the
  kernel lowers the window to that), which makes its reads up to 1 MiB;
  a sequential reader is also served from 2 MiB chunks fetched three
  ahead at once (:mod:`fuse.readahead`, at most 64 MiB for the whole
  mount), held per open file and dropped when the file is written,
  resized or closed through this mount.
- **Hard mount.** libnfs reconnects forever unless ``timeout`` is given.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, TypeVar, overload

import pyfuse3
import trio

from fuse import cgroup
from fuse.libnfs import NFSContext, NFSFile, NFSStat
from fuse.process import (
    EarlyStop,
    ReadySignal,
    await_ready,
    configure_logging,
    raise_background_limit,
    run_fuse_loop,
    set_read_ahead,
)
from fuse.readahead import Budget, ReadAhead

log = logging.getLogger("moorage.fuse.nfs")

FSTYPE: Final = "moorage-nfs"  # the FUSE subtype: /proc/mounts says fuse.moorage-nfs
ROOT: Final = b"/"
DEFAULT_CONTEXTS: Final = 4
DEFAULT_CACHE_TIMEOUT: Final = 1.0
# Asynchronous FUSE requests the kernel keeps in flight (its default: 12).
BACKGROUND_LIMIT: Final = 32
# The kernel's read-ahead on the mount, and so the size of its reads.
READ_AHEAD_KIB: Final = 1024
# open flags libnfs is told about: the kernel handles O_APPEND and O_TRUNC itself
_OPEN_FLAGS: Final = os.O_ACCMODE | os.O_SYNC | os.O_DSYNC
_DOTS: Final = (b".", b"..")
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_EXPORT_PATH = re.compile(r"/[A-Za-z0-9._/-]*")

T = TypeVar("T")


class MountError(RuntimeError):
    """A mount or unmount that did not happen, with the reason."""


# ------------------------------------------------------------------ the export


@dataclass(frozen=True)
class NFSExport:
    """Where an export is: ``server:port:/path`` plus the MOUNT protocol's port."""

    server: str
    port: int
    path: str
    mount_port: int | None = None

    def __post_init__(self) -> None:
        # fsname becomes a mount option: no commas, spaces or quotes may reach it
        if not _HOST.fullmatch(self.server):
            raise ValueError(f"NFS server must be a host name or address: {self.server!r}")
        if not _EXPORT_PATH.fullmatch(self.path):
            raise ValueError(f"NFS export path must be an absolute path: {self.path!r}")
        for port in (self.port, self.mount_port):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"port out of range: {port}")

    @classmethod
    def parse(cls, text: str, mount_port: int | None = None) -> NFSExport:
        """``SERVER:PORT:/PATH`` (an IPv6 server in brackets)."""
        match = re.fullmatch(r"(\[[^\]]*\]|[^:]+):(\d+):(/.*)", text)
        if match is None:
            raise ValueError(f"expected SERVER:PORT:/PATH, not {text!r}")
        return cls(match[1], int(match[2]), match[3], mount_port)

    @property
    def host(self) -> str:
        """The server as a socket address (no brackets)."""
        return self.server.strip("[]")

    @property
    def fsname(self) -> str:
        return f"{FSTYPE}:{self.server}:{self.path}"


# ------------------------------------------------------------------ contexts


class ContextPool:
    """Mounted libnfs contexts, each lent to one worker thread at a time."""

    def __init__(self, contexts: Sequence[NFSContext]) -> None:
        if not contexts:
            raise ValueError("a context pool needs at least one context")
        self.size = len(contexts)
        self._send, self._idle = trio.open_memory_channel[NFSContext](self.size)
        for context in contexts:
            self._send.send_nowait(context)
        self._threads = trio.CapacityLimiter(self.size)

    @classmethod
    def mount(cls, export: NFSExport, size: int, timeout: float | None = None) -> ContextPool:
        """Open ``size`` connections to the export (blocking; before the FUSE loop)."""
        contexts: list[NFSContext] = []
        try:
            for _ in range(size):
                context = NFSContext()
                contexts.append(context)
                context.mount(
                    export.host,
                    export.path,
                    nfs_port=export.port,
                    mount_port=export.mount_port,
                    timeout_ms=None if timeout is None else int(timeout * 1000),
                )
        except BaseException:
            for context in contexts:
                context.destroy()
            raise
        return cls(contexts)

    async def run(self, fn: Callable[[NFSContext], T]) -> T:
        """``fn(context)`` in a worker thread; what it raises is raised here."""
        context = await self._idle.receive()

        results: list[T] = []

        def call() -> Exception | None:
            try:
                results.append(fn(context))
            except Exception as e:  # raised below, once the context is back in the pool
                return e
            return None

        # Abandoned on cancellation (shutdown): the thread may still be using
        # the context, so it is never lent again, nor destroyed.  Its own
        # limiter keeps these threads out of trio's default one.
        error = await trio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._threads)
        self._send.send_nowait(context)
        if error is not None:
            raise error
        return results[0]

    def run_now(self, fn: Callable[[NFSContext], T]) -> T:
        """``fn(context)`` in this thread: only before the FUSE loop runs."""
        context = self._idle.receive_nowait()
        try:
            return fn(context)
        finally:
            self._send.send_nowait(context)

    def close(self) -> None:
        """Destroy every idle context (those in use by an abandoned thread are left)."""
        while True:
            try:
                self._idle.receive_nowait().destroy()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break


# ------------------------------------------------------------------ the filesystem


@dataclass
class _Node:
    path: bytes | None  # None once its name is gone (unlinked, replaced)
    lookups: int = 0


@dataclass
class _OpenFile:
    file: NFSFile
    inode: int
    ahead: ReadAhead
    dirty: bool = False  # written since the last COMMIT


@dataclass
class _OpenDir:
    inode: int
    path: bytes
    entries: list[tuple[bytes, NFSStat]] = field(default_factory=list)


def _join(parent: bytes, name: bytes) -> bytes:
    return (parent if parent != ROOT else b"") + b"/" + name


def _dirname(path: bytes) -> bytes:
    return path.rsplit(b"/", 1)[0] or ROOT


class NFSFilesystem(pyfuse3.Operations):
    """The export, as a pyfuse3 filesystem."""

    def __init__(
        self, pool: ContextPool, root_fileid: int, cache_timeout: float = DEFAULT_CACHE_TIMEOUT
    ) -> None:
        super().__init__()
        self.pool = pool
        self.root_fileid = root_fileid
        self.cache_timeout = cache_timeout
        self.uid, self.gid = os.geteuid(), os.getegid()
        self._nodes: dict[int, _Node] = {pyfuse3.ROOT_INODE: _Node(ROOT, 1)}
        self._by_path: dict[bytes, int] = {ROOT: pyfuse3.ROOT_INODE}
        self._files: dict[int, _OpenFile] = {}
        self._read_ahead = Budget()
        self._dirs: dict[int, _OpenDir] = {}
        self._next_fh = 1
        # Called with the first request after FUSE_INIT (see serve).
        self.after_init: Callable[[], object] | None = None

    def _first_requests(self) -> None:
        hook, self.after_init = self.after_init, None
        if hook is not None:
            hook()

    # -------------------------------------------------------------- plumbing

    async def _run(self, fn: Callable[[NFSContext], T]) -> T:
        try:
            return await self.pool.run(fn)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            log.debug("%s", e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except ValueError as e:  # a handle used after close
            log.debug("%s", e)
            raise pyfuse3.FUSEError(errno.EBADF) from None
        except Exception:
            # anything but FUSEError would end pyfuse3's loop, and the mount with it
            log.exception("unexpected error in an NFS call")
            raise pyfuse3.FUSEError(errno.EIO) from None

    def _inode(self, fileid: int) -> int:
        # swap the export root's fileid with FUSE's root inode, both ways
        if fileid == self.root_fileid:
            return int(pyfuse3.ROOT_INODE)
        if fileid == pyfuse3.ROOT_INODE:
            return self.root_fileid
        return fileid

    def _attributes(self, st: NFSStat) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = self._inode(st.ino)
        attr.generation = 0
        attr.entry_timeout = self.cache_timeout
        attr.attr_timeout = self.cache_timeout
        attr.st_mode = st.mode
        attr.st_nlink = st.nlink
        attr.st_uid = st.uid
        attr.st_gid = st.gid
        attr.st_rdev = st.rdev
        attr.st_size = st.size
        attr.st_blksize = st.blksize or 4096
        attr.st_blocks = st.blocks
        attr.st_atime_ns = st.atime_ns
        attr.st_mtime_ns = st.mtime_ns
        attr.st_ctime_ns = st.ctime_ns
        return attr

    def _remember(self, path: bytes, st: NFSStat) -> pyfuse3.EntryAttributes:
        """Attributes of a name the kernel now holds one more lookup of."""
        attr = self._attributes(st)
        node = self._nodes.setdefault(attr.st_ino, _Node(None))
        self._name(attr.st_ino, node, path if attr.st_ino != pyfuse3.ROOT_INODE else ROOT)
        node.lookups += 1
        return attr

    def _name(self, inode: int, node: _Node, path: bytes | None) -> None:
        """Give ``inode`` its path (one path names one inode; the last seen wins)."""
        if node.path is not None and self._by_path.get(node.path) == inode:
            del self._by_path[node.path]
        node.path = path
        if path is not None:
            displaced = self._by_path.get(path)
            if displaced is not None and displaced != inode:
                self._nodes[displaced].path = None
            self._by_path[path] = inode

    def _path(self, inode: int) -> bytes:
        node = self._nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        if node.path is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node.path

    def _open_file(self, inode: int) -> NFSFile | None:
        for handle in self._files.values():
            if handle.inode == inode and not handle.file.closed:
                return handle.file
        return None

    def _check_same(self, inode: int, st: NFSStat) -> NFSStat:
        if self._inode(st.ino) != inode:
            raise pyfuse3.FUSEError(errno.ESTALE)  # the kernel looks the name up again
        return st

    def _gone(self, path: bytes) -> None:
        inode = self._by_path.pop(path, None)
        if inode is not None:
            self._nodes[inode].path = None

    def _moved(self, old: bytes, new: bytes) -> None:
        self._gone(new)
        prefix = old + b"/"
        for path, inode in list(self._by_path.items()):
            if path == old or path.startswith(prefix):
                self._name(inode, self._nodes[inode], new + path[len(old) :])

    def _give_to_caller(
        self, context: NFSContext, path: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        """Make a new object the caller's, as a local filesystem would."""
        if (ctx.uid, ctx.gid) == (self.uid, self.gid):
            return
        parent = context.lstat(_dirname(path))
        # a set-group-ID directory passes its group on (the server did that already)
        gid = -1 if parent.mode & stat.S_ISGID else ctx.gid
        try:
            context.lchown(path, ctx.uid, gid)
        except OSError as e:
            log.warning("cannot give %r to uid %d: %s", path, ctx.uid, e)

    # -------------------------------------------------------------- attributes

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._first_requests()
        parent = self._path(parent_inode)
        if name == b".":
            path = parent
        elif name == b"..":
            path = _dirname(parent)
        else:
            path = _join(parent, name)
        st = await self._run(lambda c: c.lstat(path))
        return self._remember(path, st)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            node = self._nodes.get(inode)
            if node is None or inode == pyfuse3.ROOT_INODE:
                continue
            node.lookups -= count
            if node.lookups <= 0:
                self._name(inode, node, None)
                del self._nodes[inode]

    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self._first_requests()
        node = self._nodes.get(inode)
        path = node.path if node is not None else None
        file = self._open_file(inode)
        if path is None and file is None:
            raise pyfuse3.FUSEError(errno.ESTALE if node is None else errno.ENOENT)
        if path is not None:
            try:
                st = await self._run(lambda c: c.lstat(path))
                return self._attributes(self._check_same(inode, st))
            except pyfuse3.FUSEError:
                if file is None:
                    raise
        assert file is not None  # its name is gone, but it is open: ask by handle
        return self._attributes(await self._run(lambda c: c.fstat(file)))

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        file = self._files[fh].file if fh is not None and fh in self._files else None
        node = self._nodes.get(inode)
        path = node.path if node is not None else None
        if path is None and file is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if fields.update_size:
            self._drop_read_ahead(inode)

        def change(c: NFSContext) -> NFSStat:
            named = path
            if named is not None and file is not None:
                try:
                    if self._inode(c.lstat(named).ino) != inode:
                        named = None  # another object has the name now: use the handle
                except OSError:
                    named = None
            elif named is not None:
                self._check_same(inode, c.lstat(named))
            if fields.update_mode:
                if file is not None:
                    c.fchmod(file, attr.st_mode)
                elif named is not None:
                    c.lchmod(named, attr.st_mode)
            if fields.update_uid or fields.update_gid:
                uid = attr.st_uid if fields.update_uid else -1
                gid = attr.st_gid if fields.update_gid else -1
                if file is not None:
                    c.fchown(file, uid, gid)
                elif named is not None:
                    c.lchown(named, uid, gid)
            if fields.update_size:
                if file is not None:
                    c.ftruncate(file, attr.st_size)
                elif named is not None:
                    c.truncate(named, attr.st_size)
            if fields.update_atime or fields.update_mtime:
                if named is None:  # libnfs 4.0.0 sets times only by path
                    raise OSError(errno.ESTALE, "no path leads to the file to set its times")
                atime, mtime = attr.st_atime_ns, attr.st_mtime_ns
                if not (fields.update_atime and fields.update_mtime):
                    now = c.lstat(named)
                    atime = atime if fields.update_atime else now.atime_ns
                    mtime = mtime if fields.update_mtime else now.mtime_ns
                c.lutimes(named, atime, mtime)
            if file is not None:
                return c.fstat(file)
            assert named is not None  # checked before the call
            return c.lstat(named)

        return self._attributes(await self._run(change))

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        self._first_requests()
        st = await self._run(lambda c: c.statvfs(ROOT))
        data = pyfuse3.StatvfsData()
        data.f_bsize = st.bsize
        data.f_frsize = st.frsize
        data.f_blocks = st.blocks
        data.f_bfree = st.bfree
        data.f_bavail = st.bavail
        data.f_files = st.files
        data.f_ffree = st.ffree
        data.f_favail = st.favail
        data.f_namemax = min(st.namemax, 255)
        return data

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        path = self._path(inode)
        return await self._run(lambda c: c.readlink(path))

    # -------------------------------------------------------------- directories

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self._first_requests()
        path = self._path(inode)

        def listing(c: NFSContext) -> list[tuple[bytes, NFSStat]]:
            entries = []
            for entry in c.listdir(path):
                if entry.name == b"." and stat.S_IFMT(entry.stat.mode):
                    self._check_same(inode, entry.stat)  # still the directory it was
                st = entry.stat
                if not stat.S_IFMT(st.mode):  # READDIRPLUS may omit attributes
                    st = c.lstat(path if entry.name in _DOTS else _join(path, entry.name))
                entries.append((entry.name, st))
            return entries

        # The whole listing is read at open (libnfs does so anyway): offsets are
        # indexes into this snapshot, so no entry is skipped or repeated.
        directory = _OpenDir(inode, path, await self._run(listing))
        fh = self._new_fh()
        self._dirs[fh] = directory
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        directory = self._dirs[fh]
        node = self._nodes.get(directory.inode)
        parent = node.path if node is not None and node.path is not None else directory.path
        for index in range(start_id, len(directory.entries)):
            name, st = directory.entries[index]
            if not pyfuse3.readdir_reply(token, name, self._attributes(st), index + 1):
                break
            if name not in _DOTS:  # the kernel holds no lookup of . and ..
                self._remember(_join(parent, name), st)

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = _join(self._path(parent_inode), name)

        def make(c: NFSContext) -> NFSStat:
            c.mkdir(path, mode & 0o7777)
            self._give_to_caller(c, path, ctx)
            return c.lstat(path)

        return self._remember(path, await self._run(make))

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = _join(self._path(parent_inode), name)
        await self._run(lambda c: c.rmdir(path))
        self._gone(path)

    # -------------------------------------------------------------- names

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = _join(self._path(parent_inode), name)
        await self._run(lambda c: c.unlink(path))
        self._gone(path)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        old = _join(self._path(parent_inode_old), name_old)
        new = _join(self._path(parent_inode_new), name_new)
        if old == new:
            return
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)  # NFSv3 cannot exchange two names

        def move(c: NFSContext) -> None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                # not atomic: NFSv3 RENAME always replaces
                try:
                    c.lstat(new)
                except FileNotFoundError:
                    pass
                else:
                    raise OSError(errno.EEXIST, "rename target exists", os.fsdecode(new))
            c.rename(old, new)

        await self._run(move)
        self._moved(old, new)

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = _join(self._path(parent_inode), name)

        def make(c: NFSContext) -> NFSStat:
            c.symlink(target, path)
            self._give_to_caller(c, path, ctx)
            return c.lstat(path)

        return self._remember(path, await self._run(make))

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        old = self._path(inode)
        path = _join(self._path(new_parent_inode), new_name)

        def make(c: NFSContext) -> NFSStat:
            c.link(old, path)
            return c.lstat(path)

        return self._remember(path, await self._run(make))

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = _join(self._path(parent_inode), name)

        def make(c: NFSContext) -> NFSStat:
            if stat.S_ISREG(mode):
                c.close(c.create(path, os.O_WRONLY | os.O_EXCL, mode))
            else:
                c.mknod(path, mode, rdev)
            self._give_to_caller(c, path, ctx)
            return c.lstat(path)

        return self._remember(path, await self._run(make))

    # -------------------------------------------------------------- files

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _file_info(self, file: NFSFile, inode: int) -> pyfuse3.FileInfo:
        fh = self._new_fh()

        async def fetch(offset: int, size: int) -> bytes:
            return await self._run(lambda c: c.pread(file, offset, size))

        self._files[fh] = _OpenFile(file, inode, ReadAhead(fetch, self._read_ahead))
        info = pyfuse3.FileInfo(fh=fh)
        info.keep_cache = False  # close-to-open: what another client wrote is read
        return info

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self._first_requests()
        path = self._path(inode)

        file = await self._run(lambda c: c.open(path, flags & _OPEN_FLAGS))
        return self._file_info(file, inode)

    async def create(
        self,
        parent_inode: int,
        name: bytes,
        mode: int,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = _join(self._path(parent_inode), name)

        def make(c: NFSContext) -> tuple[NFSFile, NFSStat]:
            file = c.create(path, flags & (_OPEN_FLAGS | os.O_EXCL), mode & 0o7777)
            try:
                self._give_to_caller(c, path, ctx)
                return file, c.fstat(file)
            except OSError:
                c.close(file)
                raise

        file, st = await self._run(make)
        attr = self._remember(path, st)
        return self._file_info(file, attr.st_ino), attr

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self._files[fh].ahead.read(off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._files[fh]
        handle.dirty = True
        self._drop_read_ahead(handle.inode)
        return await self._run(lambda c: c.pwrite(handle.file, off, buf))

    def _drop_read_ahead(self, inode: int) -> None:
        """What was read ahead of this file is stale: it was written or resized here."""
        for handle in self._files.values():
            if handle.inode == inode:
                handle.ahead.drop()

    async def _commit(self, handle: _OpenFile) -> None:
        handle.dirty = False
        try:
            await self._run(lambda c: c.fsync(handle.file))
        except pyfuse3.FUSEError:
            handle.dirty = True
            raise

    async def flush(self, fh: int) -> None:
        handle = self._files[fh]
        if handle.dirty:
            await self._commit(handle)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._commit(self._files[fh])

    async def release(self, fh: int) -> None:
        handle = self._files.pop(fh)
        try:
            await handle.ahead.aclose()  # no read of the handle may outlive it
            if handle.dirty:
                await self._commit(handle)
        finally:
            await self._run(lambda c: c.close(handle.file))


# ------------------------------------------------------------------ running a mount


def mount_options(export: NFSExport, *, allow_other: bool = True) -> set[str]:
    options = {f"fsname={export.fsname}", f"subtype={FSTYPE}", "default_permissions"}
    if allow_other:
        options.add("allow_other")
    return options


def serve(
    export: NFSExport,
    mountpoint: str | os.PathLike[str],
    *,
    contexts: int = DEFAULT_CONTEXTS,
    cache_timeout: float = DEFAULT_CACHE_TIMEOUT,
    timeout: float | None = None,
    allow_other: bool = True,
    ready: Callable[[], None] | None = None,
) -> None:
    """Mount and serve in this process until unmounted or sent SIGTERM/SIGINT.

    ``ready`` is called once the mount is in place.  SIGTERM/SIGINT unmount
    the directory before this returns (a second one abandons NFS calls still
    waiting on the server).
    """
    if not os.path.isdir(mountpoint):
        raise NotADirectoryError(errno.ENOTDIR, "mount point is not a directory", mountpoint)
    stop = EarlyStop()
    stop.install()
    pool: ContextPool | None = None
    try:
        pool = ContextPool.mount(export, contexts, timeout)
        root_fileid = pool.run_now(lambda c: c.lstat(ROOT).ino)
        if stop.signal is not None:
            return
        filesystem = NFSFilesystem(pool, root_fileid, cache_timeout)
        options = mount_options(export, allow_other=allow_other)
        pyfuse3.init(filesystem, os.fspath(mountpoint), options)
        raise_background_limit(mountpoint, BACKGROUND_LIMIT)
        filesystem.after_init = lambda: set_read_ahead(mountpoint, READ_AHEAD_KIB)
        try:
            trio.run(run_fuse_loop, ready, stop)
        finally:
            pyfuse3.close(unmount=True)
    finally:
        if pool is not None:
            pool.close()
        stop.restore()


@overload
def mount_nfs(
    server: str,
    port: int,
    mount_port: int | None,
    export_path: str,
    mountpoint: str | os.PathLike[str],
    *,
    foreground: Literal[True] = ...,
    contexts: int = ...,
    cache_timeout: float = ...,
    timeout: float | None = ...,
    allow_other: bool = ...,
    ready_timeout: float = ...,
    log_file: str | os.PathLike[str] | None = ...,
) -> None: ...


@overload
def mount_nfs(
    server: str,
    port: int,
    mount_port: int | None,
    export_path: str,
    mountpoint: str | os.PathLike[str],
    *,
    foreground: Literal[False],
    contexts: int = ...,
    cache_timeout: float = ...,
    timeout: float | None = ...,
    allow_other: bool = ...,
    ready_timeout: float = ...,
    log_file: str | os.PathLike[str] | None = ...,
) -> int: ...


def mount_nfs(
    server: str,
    port: int,
    mount_port: int | None,
    export_path: str,
    mountpoint: str | os.PathLike[str],
    *,
    foreground: bool = True,
    contexts: int = DEFAULT_CONTEXTS,
    cache_timeout: float = DEFAULT_CACHE_TIMEOUT,
    timeout: float | None = None,
    allow_other: bool = True,
    ready_timeout: float = 60.0,
    log_file: str | os.PathLike[str] | None = None,
) -> int | None:
    """Mount ``server:port:export_path`` on ``mountpoint`` over NFSv3.

    ``foreground``: serve in this process until unmounted (returns None).
    Otherwise start ``python -m fuse.nfsmount`` in a session of its own,
    wait until its mount is in place and return its pid; it serves until
    :func:`unmount` (or SIGTERM).  A mount that fails raises
    :class:`MountError` with the reason.  The background process logs to
    ``log_file`` (nowhere if None) and runs from "/": it outlives its caller
    and must hold neither the caller's stderr nor its working directory.
    """
    export = NFSExport(server, port, export_path, mount_port)
    if foreground:
        serve(
            export,
            mountpoint,
            contexts=contexts,
            cache_timeout=cache_timeout,
            timeout=timeout,
            allow_other=allow_other,
        )
        return None
    argv = [
        sys.executable,
        "-m",
        "fuse.nfsmount",
        f"{export.server}:{export.port}:{export.path}",
        os.path.abspath(mountpoint),
        "--contexts",
        str(contexts),
        "--cache-timeout",
        str(cache_timeout),
    ]
    if mount_port is not None:
        argv += ["--mount-port", str(mount_port)]
    if timeout is not None:
        argv += ["--timeout", str(timeout)]
    if not allow_other:
        argv.append("--no-allow-other")
    what = f"{export.fsname} on {os.fspath(mountpoint)}"
    return _start_mount_process(argv, mountpoint, what, ready_timeout, log_file)


def _start_mount_process(
    argv: list[str],
    mountpoint: str | os.PathLike[str],
    what: str,
    ready_timeout: float,
    log_file: str | os.PathLike[str] | None,
) -> int:
    """Run a mount process (``argv`` without ``--ready-fd``); its pid once it is ready."""
    mounted_before = is_mounted(mountpoint)
    log_fd = (
        os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        if log_file is not None
        else subprocess.DEVNULL
    )
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [*argv, "--ready-fd", str(write_end)],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
            cwd="/",
            start_new_session=True,
        )
        cgroup.adopt(proc.pid)  # in a container: out of its cgroups (fuse/cgroup.py)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
        if log_fd != subprocess.DEVNULL:
            os.close(log_fd)

    def unmount_if_mounted() -> None:
        if not mounted_before and is_mounted(mountpoint):  # killed after mounting
            unmount(mountpoint, lazy=True)

    failure = await_ready(
        proc, read_end, ready_timeout, unmount_if_mounted, lambda: "it stopped before mounting"
    )
    if failure is None:
        return proc.pid
    raise MountError(f"{what}: mount process {failure}")


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether a moorage FUSE NFS mount sits on ``mountpoint`` (per /proc/self/mounts)."""
    target = os.fsencode(os.path.abspath(mountpoint))
    try:
        with open("/proc/self/mounts", "rb") as mounts:
            return any(
                fields[1] == target and fields[2] == f"fuse.{FSTYPE}".encode()
                for fields in (line.split() for line in mounts)
            )
    except FileNotFoundError:
        return False


def unmount(mountpoint: str | os.PathLike[str], *, lazy: bool = False, timeout: float = 30) -> None:
    """Unmount a FUSE mount with ``fusermount3 -u``; the mount process then exits."""
    argv = ["fusermount3", "-u", *(["-z"] if lazy else []), os.fspath(mountpoint)]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise MountError(f"{' '.join(argv)} timed out after {timeout}s") from e
    if result.returncode != 0:
        raise MountError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fuse.nfsmount",
        description="Mount an NFSv3 export through libnfs and FUSE; runs until unmounted.",
    )
    parser.add_argument("export", help="SERVER:PORT:/PATH")
    parser.add_argument("mountpoint")
    parser.add_argument("--mount-port", type=int, help="the MOUNT protocol's port (no portmapper)")
    parser.add_argument("--ready-fd", type=int, help='write "ready" here, not to stdout')
    parser.add_argument("--contexts", type=int, default=DEFAULT_CONTEXTS, help="NFS connections")
    parser.add_argument("--cache-timeout", type=float, default=DEFAULT_CACHE_TIMEOUT)
    parser.add_argument("--timeout", type=float, help="seconds per NFS call (default: retry)")
    parser.add_argument("--no-allow-other", dest="allow_other", action="store_false")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.debug)
    signal_ = ReadySignal(args.ready_fd)

    try:
        export = NFSExport.parse(args.export, args.mount_port)
        if args.contexts < 1:
            raise ValueError("--contexts must be at least 1")
        serve(
            export,
            args.mountpoint,
            contexts=args.contexts,
            cache_timeout=args.cache_timeout,
            timeout=args.timeout,
            allow_other=args.allow_other,
            ready=signal_.ready,
        )
    except (OSError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        signal_.failed(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

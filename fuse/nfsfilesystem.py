"""The NFS export as a pyfuse3 filesystem: every request becomes libnfs calls.

Choices, and why:

- **Paths, not handles.** libnfs 4.0.0's synchronous API is path based, so
  each inode the kernel knows maps to the path it was last seen at, counted
  by lookups and dropped at ``forget``.  Inode numbers are the server's
  fileids (the export root's swapped with FUSE's root, 1).  A path found to
  hold another object (renamed by another client) answers ``ESTALE``, which
  makes the kernel look the name up again; so does an object whose name was
  removed but which is still reached (a bind mount of a deleted directory).
- **Calls go through a pool of contexts** (:mod:`fuse.nfscontexts`), each
  in a worker thread, so the FUSE loop never blocks.
- **Permissions are checked by the kernel** (``default_permissions``): every
  call reaches the server with this process's AUTH_SYS credentials (root, on
  an export with ``no_root_squash``), and NFSv3 owners are numeric, so the
  owner and mode the server reports are the ones to check against.  A file a
  non-root caller creates is given to that caller with a ``chown``.
- **Close-to-open consistency.** Attribute and entry timeouts are short
  (``cache_timeout``), the page cache is dropped at every open, writes go
  through (no writeback cache), and ``flush`` commits a handle that was
  written, as an NFS client does at close.
- **Read-ahead.** A sequential reader is served from 2 MiB chunks fetched
  three ahead at once (:mod:`fuse.readahead`, at most 64 MiB for the whole
  mount), held per open file and dropped when the file is written, resized
  or closed through this mount.

Why this file is long: it is one pyfuse3 ``Operations`` class, and its
handlers share one inode table (inode to path, counted by lookups) whose
rules would be spread over files if the handlers were.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

import pyfuse3

from fuse.libnfs import NFSContext, NFSFile, NFSStat
from fuse.nfscontexts import ContextPool
from fuse.readahead import Budget, ReadAhead

log = logging.getLogger("moorage.fuse.nfs")

ROOT: Final = b"/"
DEFAULT_CACHE_TIMEOUT: Final = 1.0
# open flags libnfs is told about: the kernel handles O_APPEND and O_TRUNC itself
_OPEN_FLAGS: Final = os.O_ACCMODE | os.O_SYNC | os.O_DSYNC
_DOTS: Final = (b".", b"..")

T = TypeVar("T")


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
            raise pyfuse3.FUSEError(errno.ESTALE)  # its name is gone: as a kernel NFS client
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
            # known, but removed (still reached through a bind mount, a process's
            # working directory): a kernel NFS client says ESTALE, and kubelet's
            # clean-up of a subPath whose directory was deleted relies on it
            raise pyfuse3.FUSEError(errno.ESTALE)
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
            raise pyfuse3.FUSEError(errno.ESTALE)
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

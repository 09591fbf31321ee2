"""ctypes bindings to libnfs's synchronous API (Debian's libnfs13, 4.0.0).

Only what the FUSE NFS mount needs, over NFSv3 (libnfs 4.0.0 cannot encode an
NFSv4 WRITE above about 4 KB).  Layouts and signatures were checked against
``/usr/include/nfsc/libnfs.h`` of ``libnfs-dev 4.0.0-1+deb12u1``; the headers
are not needed at run time.  Facts of 4.0.0 this relies on:

- There is no ``nfs_set_nfsport``/``nfs_set_mountport``: the ports are set on
  a context by URL arguments (``nfsport=``, ``mountport=``) that
  ``nfs_parse_url_*`` apply to it, after which ``nfs_mount`` uses them.
- Every call returns ``-errno`` on failure; ``nfs_get_error`` has the text.
- ``struct nfsdirent`` carries READDIRPLUS attributes; ``nfs_opendir`` reads
  the whole directory, ``nfs_readdir`` never blocks.
- The dircache (on by default) serves lookups and listings from what this
  context saw earlier; other contexts and other clients make it stale, so
  :meth:`NFSContext.mount` turns it off.

A context is **not** thread-safe: one thread at a time may use it.  An
:class:`NFSFile` is an NFSv3 file handle, which the server honours on any
connection, so a file opened on one context may be read, written, synced
and closed on another context mounted on the same export.

Why this file is long: it holds the binding and nothing else (C layouts,
signatures, one Python method per libnfs call), and each method is a few
lines over a layout or signature above it that was checked against the
same header; in pieces, a call would sit away from the layout it fills.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, cast

LIBRARY: Final = "libnfs.so.13"
NFS_V3: Final = 3
# NFSv3 attribute types (libnfs-raw-nfs.h: ftype3) -> S_IF* bits
_FTYPE: Final = {
    1: 0o100000,  # NF3REG
    2: 0o040000,  # NF3DIR
    3: 0o060000,  # NF3BLK
    4: 0o020000,  # NF3CHR
    5: 0o120000,  # NF3LNK
    6: 0o140000,  # NF3SOCK
    7: 0o010000,  # NF3FIFO
}
_S_IFMT: Final = 0o170000


# ------------------------------------------------------------------ C layouts


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _NFSStat64(ctypes.Structure):
    """``struct nfs_stat_64``: every field 64 bits, 136 bytes."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "nfs_dev",
            "nfs_ino",
            "nfs_mode",
            "nfs_nlink",
            "nfs_uid",
            "nfs_gid",
            "nfs_rdev",
            "nfs_size",
            "nfs_blksize",
            "nfs_blocks",
            "nfs_atime",
            "nfs_mtime",
            "nfs_ctime",
            "nfs_atime_nsec",
            "nfs_mtime_nsec",
            "nfs_ctime_nsec",
            "nfs_used",
        )
    ]


class _NFSStatvfs64(ctypes.Structure):
    """``struct nfs_statvfs_64``: 88 bytes."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_fsid",
            "f_flag",
            "f_namemax",
        )
    ]


class _NFSDirent(ctypes.Structure):
    """``struct nfsdirent``: 160 bytes on x86_64."""


_NFSDirent._fields_ = [
    ("next", ctypes.POINTER(_NFSDirent)),
    ("name", ctypes.c_char_p),
    ("inode", ctypes.c_uint64),
    ("type", ctypes.c_uint32),
    ("mode", ctypes.c_uint32),
    ("size", ctypes.c_uint64),
    ("atime", _Timeval),
    ("mtime", _Timeval),
    ("ctime", _Timeval),
    ("uid", ctypes.c_uint32),
    ("gid", ctypes.c_uint32),
    ("nlink", ctypes.c_uint32),
    ("dev", ctypes.c_uint64),
    ("rdev", ctypes.c_uint64),
    ("blksize", ctypes.c_uint64),
    ("blocks", ctypes.c_uint64),
    ("used", ctypes.c_uint64),
    ("atime_nsec", ctypes.c_uint32),
    ("mtime_nsec", ctypes.c_uint32),
    ("ctime_nsec", ctypes.c_uint32),
]


class _NFSUrl(ctypes.Structure):
    _fields_ = [("server", ctypes.c_char_p), ("path", ctypes.c_char_p), ("file", ctypes.c_char_p)]


# ------------------------------------------------------------------ the library

_P = ctypes.c_void_p
_S = ctypes.c_char_p
_I = ctypes.c_int
_U64 = ctypes.c_uint64
_PP = ctypes.POINTER(ctypes.c_void_p)
_PTV = ctypes.POINTER(_Timeval)

# name: (restype, argtypes)
_SIGNATURES: Final[dict[str, tuple[Any, list[Any]]]] = {
    "nfs_init_context": (_P, []),
    "nfs_destroy_context": (None, [_P]),
    "nfs_get_error": (_S, [_P]),
    "nfs_parse_url_incomplete": (ctypes.POINTER(_NFSUrl), [_P, _S]),
    "nfs_destroy_url": (None, [ctypes.POINTER(_NFSUrl)]),
    "nfs_set_version": (_I, [_P, _I]),
    "nfs_set_uid": (None, [_P, _I]),
    "nfs_set_gid": (None, [_P, _I]),
    "nfs_set_dircache": (None, [_P, _I]),
    "nfs_set_autoreconnect": (None, [_P, _I]),
    "nfs_set_timeout": (None, [_P, _I]),
    "nfs_umask": (ctypes.c_uint16, [_P, ctypes.c_uint16]),
    "nfs_get_readmax": (_U64, [_P]),
    "nfs_get_writemax": (_U64, [_P]),
    "nfs_mount": (_I, [_P, _S, _S]),
    "nfs_stat64": (_I, [_P, _S, ctypes.POINTER(_NFSStat64)]),
    "nfs_lstat64": (_I, [_P, _S, ctypes.POINTER(_NFSStat64)]),
    "nfs_fstat64": (_I, [_P, _P, ctypes.POINTER(_NFSStat64)]),
    "nfs_open": (_I, [_P, _S, _I, _PP]),
    "nfs_create": (_I, [_P, _S, _I, _I, _PP]),
    "nfs_close": (_I, [_P, _P]),
    "nfs_pread": (_I, [_P, _P, _U64, _U64, _P]),
    "nfs_pwrite": (_I, [_P, _P, _U64, _U64, _P]),
    "nfs_fsync": (_I, [_P, _P]),
    "nfs_truncate": (_I, [_P, _S, _U64]),
    "nfs_ftruncate": (_I, [_P, _P, _U64]),
    "nfs_mkdir2": (_I, [_P, _S, _I]),
    "nfs_rmdir": (_I, [_P, _S]),
    "nfs_unlink": (_I, [_P, _S]),
    "nfs_mknod": (_I, [_P, _S, _I, _I]),
    "nfs_rename": (_I, [_P, _S, _S]),
    "nfs_link": (_I, [_P, _S, _S]),
    "nfs_symlink": (_I, [_P, _S, _S]),
    "nfs_readlink2": (_I, [_P, _S, ctypes.POINTER(ctypes.c_void_p)]),
    "nfs_lchmod": (_I, [_P, _S, _I]),
    "nfs_fchmod": (_I, [_P, _P, _I]),
    "nfs_lchown": (_I, [_P, _S, _I, _I]),
    "nfs_fchown": (_I, [_P, _P, _I, _I]),
    "nfs_lutimes": (_I, [_P, _S, _PTV]),
    "nfs_opendir": (_I, [_P, _S, _PP]),
    "nfs_readdir": (ctypes.POINTER(_NFSDirent), [_P, _P]),
    "nfs_closedir": (None, [_P, _P]),
    "nfs_statvfs64": (_I, [_P, _S, ctypes.POINTER(_NFSStatvfs64)]),
}

_lib: ctypes.CDLL | None = None
_libc_free: Any = None
_load_lock = threading.Lock()


def load_library() -> ctypes.CDLL:
    """libnfs, loaded once with every signature set (``OSError`` when it is missing)."""
    global _lib, _libc_free
    with _load_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL(LIBRARY, use_errno=True)
            except OSError:
                found = ctypes.util.find_library("nfs")
                if found is None:
                    raise OSError(f"{LIBRARY} not found (install libnfs13)") from None
                lib = ctypes.CDLL(found, use_errno=True)
            for name, (restype, argtypes) in _SIGNATURES.items():
                function = getattr(lib, name)
                function.restype = restype
                function.argtypes = argtypes
            libc = ctypes.CDLL(None)
            libc.free.restype = None
            libc.free.argtypes = [ctypes.c_void_p]
            _libc_free = libc.free
            _lib = lib
        return _lib


# ------------------------------------------------------------------ results


@dataclass(frozen=True, slots=True)
class NFSStat:
    """Attributes of one object; ``mode`` carries the ``S_IF*`` type bits."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    blksize: int
    blocks: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


@dataclass(frozen=True, slots=True)
class NFSStatvfs:
    bsize: int
    frsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    favail: int
    namemax: int


@dataclass(frozen=True, slots=True)
class NFSDirEntry:
    name: bytes
    stat: NFSStat


def _stat(st: _NFSStat64) -> NFSStat:
    return NFSStat(
        ino=st.nfs_ino,
        mode=st.nfs_mode,
        nlink=st.nfs_nlink,
        uid=st.nfs_uid,
        gid=st.nfs_gid,
        rdev=st.nfs_rdev,
        size=st.nfs_size,
        blksize=st.nfs_blksize,
        blocks=st.nfs_blocks,
        atime_ns=st.nfs_atime * 1_000_000_000 + st.nfs_atime_nsec,
        mtime_ns=st.nfs_mtime * 1_000_000_000 + st.nfs_mtime_nsec,
        ctime_ns=st.nfs_ctime * 1_000_000_000 + st.nfs_ctime_nsec,
    )


def _dirent_stat(d: _NFSDirent) -> NFSStat:
    mode = d.mode
    if not mode & _S_IFMT:
        mode |= _FTYPE.get(d.type, 0)
    return NFSStat(
        ino=d.inode,
        mode=mode,
        nlink=d.nlink,
        uid=d.uid,
        gid=d.gid,
        rdev=d.rdev,
        size=d.size,
        blksize=d.blksize,
        blocks=d.blocks,
        atime_ns=d.atime.tv_sec * 1_000_000_000 + d.atime_nsec,
        mtime_ns=d.mtime.tv_sec * 1_000_000_000 + d.mtime_nsec,
        ctime_ns=d.ctime.tv_sec * 1_000_000_000 + d.ctime_nsec,
    )


def _timeval(ns: int) -> _Timeval:
    # libnfs 4.0.0 has no utimensat: times travel with microsecond precision
    return _Timeval(ns // 1_000_000_000, (ns % 1_000_000_000) // 1000)


def _bytes(path: bytes | str) -> bytes:
    return os.fsencode(path)


# ------------------------------------------------------------------ objects


class NFSFile:
    """An open NFSv3 file (``struct nfsfh *``); close it exactly once."""

    __slots__ = ("_handle", "path")

    def __init__(self, handle: int, path: bytes) -> None:
        self._handle: int | None = handle
        self.path = path

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError(f"NFS file {self.path!r} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _detach(self) -> int:
        handle = self.handle
        self._handle = None
        return handle


class NFSContext:
    """One libnfs context: one connection to one export, used by one thread at a time."""

    def __init__(self) -> None:
        self._lib = load_library()
        ctx = self._lib.nfs_init_context()
        if not ctx:
            raise OSError("nfs_init_context failed")
        self._ctx: int | None = ctx

    # -------------------------------------------------------------- lifecycle

    @property
    def ctx(self) -> int:
        if self._ctx is None:
            raise ValueError("NFS context is destroyed")
        return self._ctx

    def destroy(self) -> None:
        """Close the connection and free the context (idempotent)."""
        if self._ctx is not None:
            self._lib.nfs_destroy_context(self._ctx)
            self._ctx = None

    def __enter__(self) -> NFSContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def error(self) -> str:
        message = self._lib.nfs_get_error(self.ctx)
        return message.decode(errors="replace") if message else ""

    def _check(self, ret: int, what: str, path: bytes | None = None) -> int:
        if ret < 0:
            code = -ret
            text = self.error() or os.strerror(code)
            if path is None:
                raise OSError(code, f"{what}: {text}")
            raise OSError(code, f"{what}: {text}", os.fsdecode(path))
        return ret

    def mount(
        self,
        server: str,
        export: str,
        *,
        nfs_port: int | None = None,
        mount_port: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        timeout_ms: int | None = None,
    ) -> None:
        """Mount ``server:export`` over NFSv3 on this context.

        Explicit ports skip the portmapper.  ``uid``/``gid`` are the AUTH_SYS
        credentials of every call (default: this process's effective ids).
        """
        lib, ctx = self._lib, self.ctx
        args = [f"version={NFS_V3}"]
        if nfs_port is not None:
            args.append(f"nfsport={int(nfs_port)}")
        if mount_port is not None:
            args.append(f"mountport={int(mount_port)}")
        # libnfs 4.0.0 sets ports only from URL arguments; parse a URL with no
        # server or path just for them (server and export go to nfs_mount as is).
        url = lib.nfs_parse_url_incomplete(ctx, ("nfs:///?" + "&".join(args)).encode())
        if not url:
            raise OSError(0, f"cannot apply NFS options {args}: {self.error()}")
        lib.nfs_destroy_url(url)
        self._check(lib.nfs_set_version(ctx, NFS_V3), "nfs_set_version")
        lib.nfs_set_uid(ctx, os.geteuid() if uid is None else uid)
        lib.nfs_set_gid(ctx, os.getegid() if gid is None else gid)
        lib.nfs_set_dircache(ctx, 0)
        lib.nfs_set_autoreconnect(ctx, -1)  # a hard mount: reconnect for ever
        lib.nfs_umask(ctx, 0)  # modes arrive already masked by the caller's umask
        if timeout_ms is not None:
            lib.nfs_set_timeout(ctx, timeout_ms)
        self._check(
            lib.nfs_mount(ctx, server.encode(), export.encode()),
            f"mount {server}:{export}",
        )

    @property
    def readmax(self) -> int:
        return int(self._lib.nfs_get_readmax(self.ctx))

    @property
    def writemax(self) -> int:
        return int(self._lib.nfs_get_writemax(self.ctx))

    # -------------------------------------------------------------- attributes

    def stat(self, path: bytes | str) -> NFSStat:
        """Attributes, following a final symlink."""
        p, st = _bytes(path), _NFSStat64()
        self._check(self._lib.nfs_stat64(self.ctx, p, ctypes.byref(st)), "stat", p)
        return _stat(st)

    def lstat(self, path: bytes | str) -> NFSStat:
        p, st = _bytes(path), _NFSStat64()
        self._check(self._lib.nfs_lstat64(self.ctx, p, ctypes.byref(st)), "lstat", p)
        return _stat(st)

    def fstat(self, file: NFSFile) -> NFSStat:
        st = _NFSStat64()
        self._check(
            self._lib.nfs_fstat64(self.ctx, file.handle, ctypes.byref(st)), "fstat", file.path
        )
        return _stat(st)

    def lchmod(self, path: bytes | str, mode: int) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_lchmod(self.ctx, p, mode & 0o7777), "chmod", p)

    def fchmod(self, file: NFSFile, mode: int) -> None:
        self._check(self._lib.nfs_fchmod(self.ctx, file.handle, mode & 0o7777), "fchmod", file.path)

    def lchown(self, path: bytes | str, uid: int, gid: int) -> None:
        """Set the owner; -1 leaves that id unchanged."""
        p = _bytes(path)
        self._check(self._lib.nfs_lchown(self.ctx, p, uid, gid), "chown", p)

    def fchown(self, file: NFSFile, uid: int, gid: int) -> None:
        self._check(self._lib.nfs_fchown(self.ctx, file.handle, uid, gid), "fchown", file.path)

    def lutimes(self, path: bytes | str, atime_ns: int, mtime_ns: int) -> None:
        """Set both times of the object itself (microsecond precision)."""
        p = _bytes(path)
        times = (_Timeval * 2)(_timeval(atime_ns), _timeval(mtime_ns))
        self._check(self._lib.nfs_lutimes(self.ctx, p, times), "utimes", p)

    def truncate(self, path: bytes | str, length: int) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_truncate(self.ctx, p, length), "truncate", p)

    def statvfs(self, path: bytes | str = b"/") -> NFSStatvfs:
        p, st = _bytes(path), _NFSStatvfs64()
        self._check(self._lib.nfs_statvfs64(self.ctx, p, ctypes.byref(st)), "statvfs", p)
        return NFSStatvfs(
            bsize=st.f_bsize,
            frsize=st.f_frsize,
            blocks=st.f_blocks,
            bfree=st.f_bfree,
            bavail=st.f_bavail,
            files=st.f_files,
            ffree=st.f_ffree,
            favail=st.f_favail,
            namemax=st.f_namemax,
        )

    # -------------------------------------------------------------- files

    def open(self, path: bytes | str, flags: int) -> NFSFile:
        """Open an existing file (``O_TRUNC`` truncates it)."""
        p, handle = _bytes(path), ctypes.c_void_p()
        self._check(self._lib.nfs_open(self.ctx, p, flags, ctypes.byref(handle)), "open", p)
        assert handle.value is not None
        return NFSFile(handle.value, p)

    def create(self, path: bytes | str, flags: int, mode: int) -> NFSFile:
        """Create and open a file; ``O_EXCL`` fails on an existing one."""
        p, handle = _bytes(path), ctypes.c_void_p()
        self._check(
            self._lib.nfs_create(self.ctx, p, flags, mode & 0o7777, ctypes.byref(handle)),
            "create",
            p,
        )
        assert handle.value is not None
        return NFSFile(handle.value, p)

    def close(self, file: NFSFile) -> None:
        """Free the handle (NFSv3 has no CLOSE: nothing is sent)."""
        if not file.closed:
            path = file.path
            self._check(self._lib.nfs_close(self.ctx, file._detach()), "close", path)

    def pread(self, file: NFSFile, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; fewer only at end of file."""
        buf = bytearray(size)
        view = (ctypes.c_char * size).from_buffer(buf) if size else None
        done = 0
        while done < size:
            n = self._check(
                self._lib.nfs_pread(
                    self.ctx,
                    file.handle,
                    offset + done,
                    size - done,
                    ctypes.addressof(view) + done if view is not None else None,
                ),
                "read",
                file.path,
            )
            if n == 0:
                break
            done += n
        del view
        if done < size:
            del buf[done:]
        return cast(bytes, buf)  # a bytearray: callers only read it, copying it is waste

    def pwrite(self, file: NFSFile, offset: int, data: bytes) -> int:
        """Write all of ``data`` at ``offset`` (unstable: :meth:`fsync` commits it)."""
        size = len(data)
        pinned = ctypes.c_char_p(data)  # points into ``data`` itself: no copy
        address = ctypes.cast(pinned, ctypes.c_void_p).value or 0
        done = 0
        while done < size:
            n = self._check(
                self._lib.nfs_pwrite(
                    self.ctx, file.handle, offset + done, size - done, address + done
                ),
                "write",
                file.path,
            )
            if n == 0:
                raise OSError(5, "write: the server accepted no data", os.fsdecode(file.path))
            done += n
        return done

    def fsync(self, file: NFSFile) -> None:
        """COMMIT what was written through this handle to stable storage."""
        self._check(self._lib.nfs_fsync(self.ctx, file.handle), "fsync", file.path)

    def ftruncate(self, file: NFSFile, length: int) -> None:
        self._check(self._lib.nfs_ftruncate(self.ctx, file.handle, length), "ftruncate", file.path)

    # -------------------------------------------------------------- namespace

    def mkdir(self, path: bytes | str, mode: int = 0o777) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_mkdir2(self.ctx, p, mode & 0o7777), "mkdir", p)

    def rmdir(self, path: bytes | str) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_rmdir(self.ctx, p), "rmdir", p)

    def unlink(self, path: bytes | str) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_unlink(self.ctx, p), "unlink", p)

    def mknod(self, path: bytes | str, mode: int, rdev: int = 0) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_mknod(self.ctx, p, mode, rdev), "mknod", p)

    def rename(self, old: bytes | str, new: bytes | str) -> None:
        o, n = _bytes(old), _bytes(new)
        self._check(self._lib.nfs_rename(self.ctx, o, n), "rename", o)

    def link(self, old: bytes | str, new: bytes | str) -> None:
        o, n = _bytes(old), _bytes(new)
        self._check(self._lib.nfs_link(self.ctx, o, n), "link", n)

    def symlink(self, target: bytes | str, path: bytes | str) -> None:
        p = _bytes(path)
        self._check(self._lib.nfs_symlink(self.ctx, _bytes(target), p), "symlink", p)

    def readlink(self, path: bytes | str) -> bytes:
        p, out = _bytes(path), ctypes.c_void_p()
        self._check(self._lib.nfs_readlink2(self.ctx, p, ctypes.byref(out)), "readlink", p)
        try:
            return ctypes.string_at(out.value) if out.value else b""
        finally:
            if out.value:
                _libc_free(out.value)

    def listdir(self, path: bytes | str) -> list[NFSDirEntry]:
        """Every entry of a directory with its attributes, ``.`` and ``..`` included."""
        p, handle = _bytes(path), ctypes.c_void_p()
        self._check(self._lib.nfs_opendir(self.ctx, p, ctypes.byref(handle)), "opendir", p)
        entries: list[NFSDirEntry] = []
        try:
            while True:
                dirent = self._lib.nfs_readdir(self.ctx, handle)
                if not dirent:
                    break
                d = dirent.contents
                entries.append(NFSDirEntry(d.name or b"", _dirent_stat(d)))
        finally:
            self._lib.nfs_closedir(self.ctx, handle)
        return entries


@contextmanager
def mounted(
    server: str,
    export: str,
    *,
    nfs_port: int | None = None,
    mount_port: int | None = None,
    timeout_ms: int | None = None,
) -> Iterator[NFSContext]:
    """A context mounted on ``server:export``, destroyed on exit."""
    context = NFSContext()
    try:
        context.mount(
            server, export, nfs_port=nfs_port, mount_port=mount_port, timeout_ms=timeout_ms
        )
        yield context
    finally:
        context.destroy()

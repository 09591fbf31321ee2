"""The part of the FUSE kernel protocol (``linux/fuse.h``, 7.38) the block file speaks.

Pure data: request headers and bodies unpacked with :mod:`struct`, replies
packed; no I/O.  :mod:`fuse.blockfile` reads requests from ``/dev/fuse``
and writes these replies back.  ``tests/unit/test_fuse_proto.py`` checks
every layout here against the installed ``linux/fuse.h`` with a C compiler.

Every request starts with ``fuse_in_header`` (40 bytes: its length, opcode,
unique id, node id, the caller's uid/gid/pid); every reply with
``fuse_out_header`` (16 bytes: length, negative errno or 0, the unique id
it answers).  A request whose body is shorter than its opcode's structure
is answered with ``EINVAL`` (:class:`Malformed`); one shorter than its
header cannot be answered at all and is dropped.
"""

from __future__ import annotations

import errno
import struct
from typing import Final, NamedTuple

KERNEL_VERSION: Final = 7
KERNEL_MINOR_VERSION: Final = 38  # the structure sizes below are 7.38's
ROOT_ID: Final = 1
MIN_READ_BUFFER: Final = 8192

# opcodes (enum fuse_opcode)
LOOKUP: Final = 1
FORGET: Final = 2
GETATTR: Final = 3
SETATTR: Final = 4
OPEN: Final = 14
READ: Final = 15
WRITE: Final = 16
STATFS: Final = 17
RELEASE: Final = 18
FSYNC: Final = 20
FLUSH: Final = 25
INIT: Final = 26
OPENDIR: Final = 27
READDIR: Final = 28
RELEASEDIR: Final = 29
FSYNCDIR: Final = 30
ACCESS: Final = 34
INTERRUPT: Final = 36
DESTROY: Final = 38
BATCH_FORGET: Final = 42
FALLOCATE: Final = 43
# requests the kernel expects no reply to
NO_REPLY: Final = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

# FUSE_INIT flags
ASYNC_READ: Final = 1 << 0
BIG_WRITES: Final = 1 << 5
ASYNC_DIO: Final = 1 << 15
PARALLEL_DIROPS: Final = 1 << 18
MAX_PAGES: Final = 1 << 22

# fuse_open_out.open_flags
FOPEN_DIRECT_IO: Final = 1 << 0
FOPEN_KEEP_CACHE: Final = 1 << 1
FOPEN_PARALLEL_DIRECT_WRITES: Final = 1 << 6

# fuse_setattr_in.valid
FATTR_MODE: Final = 1 << 0
FATTR_UID: Final = 1 << 1
FATTR_GID: Final = 1 << 2
FATTR_SIZE: Final = 1 << 3

# notifications (written with unique 0 and the code in the error field)
NOTIFY_INVAL_INODE: Final = 2

# _IOR(229, 0, uint32_t): a further descriptor for the same connection
DEV_IOC_CLONE: Final = (2 << 30) | (4 << 16) | (229 << 8) | 0

DT_DIR: Final = 4
DT_REG: Final = 8

IN_HEADER: Final = struct.Struct("=IIQQIIIHH")  # fuse_in_header
OUT_HEADER: Final = struct.Struct("=IiQ")  # fuse_out_header
INIT_IN: Final = struct.Struct("=IIII")  # major, minor, max_readahead, flags (7.36+: more)
INIT_OUT: Final = struct.Struct("=IIIIHHIIHHI28x")  # fuse_init_out (64 bytes)
ATTR: Final = struct.Struct("=QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
ENTRY_OUT_HEAD: Final = struct.Struct("=QQQQII")  # fuse_entry_out before its attr
ATTR_OUT_HEAD: Final = struct.Struct("=QII")  # fuse_attr_out before its attr
GETATTR_IN: Final = struct.Struct("=IIQ")
SETATTR_IN: Final = struct.Struct("=IIQQQQQQIIIIIIII")  # fuse_setattr_in (88 bytes)
OPEN_IN: Final = struct.Struct("=II")
OPEN_OUT: Final = struct.Struct("=QII")
READ_IN: Final = struct.Struct("=QQIIQII")  # fuse_read_in (40 bytes)
WRITE_IN: Final = struct.Struct("=QQIIQII")  # fuse_write_in (40 bytes); data follows
WRITE_OUT: Final = struct.Struct("=II")
RELEASE_IN: Final = struct.Struct("=QIIQ")
FLUSH_IN: Final = struct.Struct("=QIIQ")
FSYNC_IN: Final = struct.Struct("=QII")
KSTATFS: Final = struct.Struct("=QQQQQIIII24x")  # fuse_kstatfs (80 bytes)
FALLOCATE_IN: Final = struct.Struct("=QQQII")
DIRENT_HEAD: Final = struct.Struct("=QQII")  # fuse_dirent before its name
NOTIFY_INVAL_INODE_OUT: Final = struct.Struct("=Qqq")

# the fixed part of each request's body: shorter is malformed
BODY_SIZE: Final = {
    GETATTR: GETATTR_IN.size,
    SETATTR: SETATTR_IN.size,
    OPEN: OPEN_IN.size,
    OPENDIR: OPEN_IN.size,
    READ: READ_IN.size,
    READDIR: READ_IN.size,
    WRITE: WRITE_IN.size,
    RELEASE: RELEASE_IN.size,
    RELEASEDIR: RELEASE_IN.size,
    FLUSH: FLUSH_IN.size,
    FSYNC: FSYNC_IN.size,
    FSYNCDIR: FSYNC_IN.size,
    FALLOCATE: FALLOCATE_IN.size,
    INIT: INIT_IN.size,
}


class Malformed(ValueError):
    """A request the block file cannot take: answered with ``errno`` (EINVAL)."""

    def __init__(self, message: str, code: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.errno = code


class Header(NamedTuple):
    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int


def parse_header(buf: bytes | bytearray | memoryview, count: int) -> Header:
    """The header of a request read as ``count`` bytes.  :class:`Malformed` if it says
    another length than was read, or (``unique`` 0) if there is no whole header."""
    if count < IN_HEADER.size:
        raise Malformed(f"a request of {count} bytes has no header")
    length, opcode, unique, nodeid, uid, gid, pid, _, _ = IN_HEADER.unpack_from(buf)
    header = Header(length, opcode, unique, nodeid, uid, gid, pid)
    if length != count:
        raise Malformed(f"request {unique} says {length} bytes but {count} were read")
    if count - IN_HEADER.size < BODY_SIZE.get(opcode, 0):
        raise Malformed(f"request {unique} (opcode {opcode}) is too short: {count} bytes")
    return header


def error_reply(unique: int, code: int) -> bytes:
    """A reply that fails request ``unique`` with ``code`` (a positive errno)."""
    return OUT_HEADER.pack(OUT_HEADER.size, -code, unique)


def reply(unique: int, body: bytes | bytearray = b"") -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body


def reply_header(unique: int, body_length: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + body_length, 0, unique)


class Attr(NamedTuple):
    """What fuse_attr carries for the block file (times in ns, all three the same)."""

    ino: int
    size: int
    mode: int
    nlink: int
    uid: int
    gid: int
    time_ns: int
    blksize: int = 4096


def pack_attr(a: Attr) -> bytes:
    sec, nsec = divmod(a.time_ns, 1_000_000_000)
    blocks = (a.size + 511) // 512
    return ATTR.pack(
        a.ino, a.size, blocks, sec, sec, sec, nsec, nsec, nsec,
        a.mode, a.nlink, a.uid, a.gid, 0, a.blksize, 0,
    )  # fmt: skip


def _valid(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def entry_out(a: Attr, timeout: float) -> bytes:
    sec, nsec = _valid(timeout)
    return ENTRY_OUT_HEAD.pack(a.ino, 0, sec, sec, nsec, nsec) + pack_attr(a)


def attr_out(a: Attr, timeout: float) -> bytes:
    sec, nsec = _valid(timeout)
    return ATTR_OUT_HEAD.pack(sec, nsec, 0) + pack_attr(a)


def init_out(
    kernel_minor: int,
    kernel_flags: int,
    max_readahead: int,
    *,
    wanted: int,
    max_background: int,
    congestion_threshold: int,
    max_write: int,
    max_pages: int,
) -> bytes:
    """The answer to FUSE_INIT: the flags both sides have, our limits."""
    flags = kernel_flags & wanted
    return INIT_OUT.pack(
        KERNEL_VERSION,
        min(kernel_minor, KERNEL_MINOR_VERSION),
        max_readahead,
        flags,
        max_background,
        congestion_threshold,
        max_write,
        1,  # time_gran: nanoseconds
        max_pages if flags & MAX_PAGES else 0,
        0,
        0,
    )


def statfs_out(blocks: int, files: int, bsize: int = 4096, namelen: int = 255) -> bytes:
    return KSTATFS.pack(blocks, 0, 0, files, 0, bsize, namelen, bsize, 0)


def dirent(ino: int, next_offset: int, name: bytes, kind: int) -> bytes:
    """One fuse_dirent, padded to 8 bytes; ``next_offset`` is where READDIR goes on."""
    record = DIRENT_HEAD.pack(ino, next_offset, len(name), kind) + name
    return record + bytes(-len(record) % 8)


def notify_inval_inode(ino: int, offset: int = -1, length: int = 0) -> bytes:
    """Drop the kernel's cached attributes of ``ino`` (offset -1: and no data)."""
    body = NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length)
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0) + body


def name_of(body: bytes | bytearray | memoryview) -> bytes:
    """The NUL-terminated name of a LOOKUP body (Malformed without the NUL)."""
    data = bytes(body)
    end = data.find(b"\0")
    if end < 0:
        raise Malformed("a name without its terminating NUL")
    return data[:end]

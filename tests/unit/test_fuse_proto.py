"""The block file's FUSE protocol: layouts against ``linux/fuse.h``, and requests in,
replies out, without a kernel.

A small C program compiled against the installed kernel headers prints the
sizes, offsets and constants the compiler sees; :mod:`fuse.fuseproto` must
agree.  Then :class:`fuse.blockfile.BlockFile` is fed requests as bytes (a
fake export behind it) and what it would write to ``/dev/fuse`` is checked:
every malformed or short request gets an error reply (or, without a whole
header, none), never an exception.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import pytest

from fuse import fuseproto as fp
from fuse.blockfile import (
    BACKGROUND_LIMIT,
    DISK_INODE,
    MAX_PAGES,
    MAX_WRITE,
    REFRESH_INODE,
    BlockFile,
)
from tests.kernel_headers import compiled_values

# (struct name, our struct.Struct, fields before a nested struct or all of them)
SIZES = {
    "fuse_in_header": fp.IN_HEADER,
    "fuse_out_header": fp.OUT_HEADER,
    "fuse_init_out": fp.INIT_OUT,
    "fuse_attr": fp.ATTR,
    "fuse_getattr_in": fp.GETATTR_IN,
    "fuse_setattr_in": fp.SETATTR_IN,
    "fuse_open_in": fp.OPEN_IN,
    "fuse_open_out": fp.OPEN_OUT,
    "fuse_read_in": fp.READ_IN,
    "fuse_write_in": fp.WRITE_IN,
    "fuse_write_out": fp.WRITE_OUT,
    "fuse_release_in": fp.RELEASE_IN,
    "fuse_flush_in": fp.FLUSH_IN,
    "fuse_fsync_in": fp.FSYNC_IN,
    "fuse_kstatfs": fp.KSTATFS,
    "fuse_fallocate_in": fp.FALLOCATE_IN,
    "fuse_notify_inval_inode_out": fp.NOTIFY_INVAL_INODE_OUT,
}
CONSTANTS = {
    "FUSE_KERNEL_VERSION": fp.KERNEL_VERSION,
    "FUSE_ROOT_ID": fp.ROOT_ID,
    "FUSE_LOOKUP": fp.LOOKUP,
    "FUSE_FORGET": fp.FORGET,
    "FUSE_GETATTR": fp.GETATTR,
    "FUSE_SETATTR": fp.SETATTR,
    "FUSE_OPEN": fp.OPEN,
    "FUSE_READ": fp.READ,
    "FUSE_WRITE": fp.WRITE,
    "FUSE_STATFS": fp.STATFS,
    "FUSE_RELEASE": fp.RELEASE,
    "FUSE_FSYNC": fp.FSYNC,
    "FUSE_FLUSH": fp.FLUSH,
    "FUSE_INIT": fp.INIT,
    "FUSE_OPENDIR": fp.OPENDIR,
    "FUSE_READDIR": fp.READDIR,
    "FUSE_RELEASEDIR": fp.RELEASEDIR,
    "FUSE_FSYNCDIR": fp.FSYNCDIR,
    "FUSE_INTERRUPT": fp.INTERRUPT,
    "FUSE_DESTROY": fp.DESTROY,
    "FUSE_BATCH_FORGET": fp.BATCH_FORGET,
    "FUSE_FALLOCATE": fp.FALLOCATE,
    "FUSE_ASYNC_READ": fp.ASYNC_READ,
    "FUSE_BIG_WRITES": fp.BIG_WRITES,
    "FUSE_ASYNC_DIO": fp.ASYNC_DIO,
    "FUSE_MAX_PAGES": fp.MAX_PAGES,
    "FOPEN_DIRECT_IO": fp.FOPEN_DIRECT_IO,
    "FOPEN_KEEP_CACHE": fp.FOPEN_KEEP_CACHE,
    "FOPEN_PARALLEL_DIRECT_WRITES": fp.FOPEN_PARALLEL_DIRECT_WRITES,
    "FATTR_MODE": fp.FATTR_MODE,
    "FATTR_UID": fp.FATTR_UID,
    "FATTR_GID": fp.FATTR_GID,
    "FATTR_SIZE": fp.FATTR_SIZE,
    "FUSE_NOTIFY_INVAL_INODE": fp.NOTIFY_INVAL_INODE,
    "FUSE_DEV_IOC_CLONE": fp.DEV_IOC_CLONE,
    "FUSE_NAME_OFFSET": fp.DIRENT_HEAD.size,
}
# (struct, field, the offset our layout gives it)
OFFSETS = [
    ("fuse_init_out", "max_background", 16),
    ("fuse_init_out", "max_write", 20),
    ("fuse_init_out", "max_pages", 28),
    ("fuse_init_out", "flags2", 32),
    ("fuse_entry_out", "attr", fp.ENTRY_OUT_HEAD.size),
    ("fuse_attr_out", "attr", fp.ATTR_OUT_HEAD.size),
    ("fuse_setattr_in", "size", 16),
    ("fuse_setattr_in", "mode", 68),
    ("fuse_attr", "mode", 60),
    ("fuse_attr", "blksize", 80),
    ("fuse_read_in", "size", 16),
    ("fuse_kstatfs", "frsize", 48),
]


@pytest.fixture(scope="module")
def header_values(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    lines = [f'printf("sizeof.{n} %zu\\n", sizeof(struct {n}));' for n in SIZES]
    lines += [
        'printf("sizeof.fuse_entry_out %zu\\n", sizeof(struct fuse_entry_out));',
        'printf("sizeof.fuse_attr_out %zu\\n", sizeof(struct fuse_attr_out));',
    ]
    lines += [f'printf("{n} %llu\\n", (unsigned long long)({n}));' for n in CONSTANTS]
    lines += [f'printf("offset.{s}.{f} %zu\\n", offsetof(struct {s}, {f}));' for s, f, _ in OFFSETS]
    headers = ["stdint.h", "linux/fuse.h", "sys/ioctl.h"]
    return compiled_values(headers, lines, tmp_path_factory.mktemp("fuse_h"))


def test_header_is_installed() -> None:
    assert Path("/usr/include/linux/fuse.h").is_file()


@pytest.mark.parametrize("name", SIZES)
def test_struct_sizes_match_the_header(name: str, header_values: dict[str, int]) -> None:
    assert SIZES[name].size == header_values[f"sizeof.{name}"]


def test_nested_struct_sizes_match_the_header(header_values: dict[str, int]) -> None:
    attr = fp.Attr(2, 0, 0, 1, 0, 0, 0)
    assert len(fp.entry_out(attr, 1.0)) == header_values["sizeof.fuse_entry_out"]
    assert len(fp.attr_out(attr, 1.0)) == header_values["sizeof.fuse_attr_out"]


@pytest.mark.parametrize("name", CONSTANTS)
def test_constants_match_the_header(name: str, header_values: dict[str, int]) -> None:
    assert CONSTANTS[name] == header_values[name]


@pytest.mark.parametrize(("struct_name", "field", "ours"), OFFSETS)
def test_field_offsets_match_the_header(
    struct_name: str, field: str, ours: int, header_values: dict[str, int]
) -> None:
    assert ours == header_values[f"offset.{struct_name}.{field}"]


# ------------------------------------------------------------------ requests in, replies out


class FakeExport:
    """What BlockFile asks of an export, without a server: no connection ready."""

    def __init__(self, size: int = 1 << 30, read_only: bool = False) -> None:
        self.size = size
        self.read_only = read_only
        self.can_zero = True

    def ready_connection(self) -> None:
        return None


class Replies:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def __call__(self, data: bytes | bytearray) -> int:
        self.written.append(bytes(data))
        return len(data)

    def last(self) -> tuple[int, int, bytes]:
        """(error, unique, body) of the last reply, checking its length field."""
        data = self.written[-1]
        length, error, unique = fp.OUT_HEADER.unpack_from(data)
        assert length == len(data)
        return -error, unique, data[fp.OUT_HEADER.size :]


def request(opcode: int, unique: int, body: bytes = b"", nodeid: int = fp.ROOT_ID) -> bytes:
    length = fp.IN_HEADER.size + len(body)
    return fp.IN_HEADER.pack(length, opcode, unique, nodeid, 0, 0, 1, 0, 0) + body


def init_body(minor: int = 45, flags: int = 0x73FFFFFB) -> bytes:
    return fp.INIT_IN.pack(7, minor, 128 * 1024, flags) + bytes(48)


@pytest.fixture
def replies() -> Replies:
    return Replies()


@pytest.fixture
def fs(replies: Replies) -> BlockFile:
    filesystem = BlockFile(FakeExport(), write=replies)  # type: ignore[arg-type]
    send(filesystem, request(fp.INIT, 1, init_body()))
    return filesystem


def send(filesystem: BlockFile, data: bytes) -> None:
    buf = bytearray(data) + bytearray(64)  # a reused buffer has bytes past the request
    filesystem.handle(buf, len(data))


def test_init_reply_sets_our_limits(replies: Replies) -> None:
    filesystem = BlockFile(FakeExport(), write=replies)  # type: ignore[arg-type]
    send(filesystem, request(fp.INIT, 7, init_body()))
    error, unique, body = replies.last()
    assert (error, unique) == (0, 7)
    major, minor, readahead, flags, background, congestion, max_write, gran, pages = (
        fp.INIT_OUT.unpack(body)[:9]
    )
    assert (major, minor, readahead) == (7, fp.KERNEL_MINOR_VERSION, 128 * 1024)
    assert flags & fp.ASYNC_DIO and flags & fp.MAX_PAGES and flags & fp.ASYNC_READ
    assert (background, congestion) == (BACKGROUND_LIMIT, BACKGROUND_LIMIT * 3 // 4)
    assert (max_write, pages, gran) == (MAX_WRITE, MAX_PAGES, 1)
    assert filesystem.busy == 0


def test_init_takes_only_the_flags_the_kernel_offers(replies: Replies) -> None:
    filesystem = BlockFile(FakeExport(), write=replies)  # type: ignore[arg-type]
    send(filesystem, request(fp.INIT, 7, init_body(minor=31, flags=fp.ASYNC_READ)))
    _, _, body = replies.last()
    _, minor, _, flags = fp.INIT_OUT.unpack(body)[:4]
    assert (minor, flags) == (31, fp.ASYNC_READ)
    assert fp.INIT_OUT.unpack(body)[8] == 0  # no max_pages without FUSE_MAX_PAGES


def test_requests_before_init_fail(replies: Replies) -> None:
    filesystem = BlockFile(FakeExport(), write=replies)  # type: ignore[arg-type]
    send(filesystem, request(fp.GETATTR, 3, fp.GETATTR_IN.pack(0, 0, 0)))
    assert replies.last()[:2] == (errno.EIO, 3)


def test_lookup_getattr_and_readdir(fs: BlockFile, replies: Replies) -> None:
    send(fs, request(fp.LOOKUP, 10, b"disk\0"))
    error, unique, body = replies.last()
    assert (error, unique) == (0, 10)
    nodeid = struct.unpack_from("=Q", body)[0]
    attr = fp.ATTR.unpack_from(body, fp.ENTRY_OUT_HEAD.size)
    assert nodeid == DISK_INODE and attr[1] == 1 << 30 and stat.S_ISREG(attr[9])
    send(fs, request(fp.LOOKUP, 11, b"nothing\0"))
    assert replies.last()[:2] == (errno.ENOENT, 11)
    send(fs, request(fp.GETATTR, 12, fp.GETATTR_IN.pack(0, 0, 0), nodeid=REFRESH_INODE))
    error, _, body = replies.last()
    assert error == 0 and fp.ATTR.unpack_from(body, fp.ATTR_OUT_HEAD.size)[9] & 0o777 == 0o200
    send(fs, request(fp.READDIR, 13, fp.READ_IN.pack(0, 0, 4096, 0, 0, 0, 0)))
    error, _, body = replies.last()
    names = []
    while body:
        ino, _, namelen, _ = fp.DIRENT_HEAD.unpack_from(body)
        names.append((ino, body[24 : 24 + namelen]))
        body = body[(24 + namelen + 7) // 8 * 8 :]
    assert names == [(DISK_INODE, b"disk"), (REFRESH_INODE, b"refresh")]


def test_open_gives_direct_io_and_parallel_writes(fs: BlockFile, replies: Replies) -> None:
    send(fs, request(fp.OPEN, 20, fp.OPEN_IN.pack(os.O_RDWR, 0), nodeid=DISK_INODE))
    error, _, body = replies.last()
    fh, open_flags, _ = fp.OPEN_OUT.unpack(body)
    assert error == 0
    assert open_flags == fp.FOPEN_DIRECT_IO | fp.FOPEN_PARALLEL_DIRECT_WRITES
    # a read at the end of the export is answered at once with no data
    send(fs, request(fp.READ, 21, fp.READ_IN.pack(fh, 1 << 30, 4096, 0, 0, 0, 0)))
    assert replies.last() == (0, 21, b"")
    # a write past the end: ENOSPC
    send(fs, request(fp.WRITE, 22, fp.WRITE_IN.pack(fh, 1 << 30, 1, 0, 0, 0, 0) + b"x"))
    assert replies.last()[:2] == (errno.ENOSPC, 22)
    send(fs, request(fp.RELEASE, 23, fp.RELEASE_IN.pack(fh, 0, 0, 0), nodeid=DISK_INODE))
    assert replies.last() == (0, 23, b"")
    assert fs.open_files == 0 and fs.busy == 0


def test_refresh_cannot_be_read_and_disk_not_written_when_read_only(replies: Replies) -> None:
    filesystem = BlockFile(FakeExport(read_only=True), write=replies)  # type: ignore[arg-type]
    send(filesystem, request(fp.INIT, 1, init_body()))
    send(filesystem, request(fp.OPEN, 2, fp.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=REFRESH_INODE))
    assert replies.last()[:2] == (errno.EACCES, 2)
    send(filesystem, request(fp.OPEN, 3, fp.OPEN_IN.pack(os.O_WRONLY, 0), nodeid=DISK_INODE))
    assert replies.last()[:2] == (errno.EROFS, 3)


def test_setattr_cannot_change_the_size(fs: BlockFile, replies: Replies) -> None:
    body = bytearray(fp.SETATTR_IN.size)
    struct.pack_into("=I", body, 0, fp.FATTR_SIZE)
    struct.pack_into("=Q", body, 16, 4096)
    send(fs, request(fp.SETATTR, 30, bytes(body), nodeid=DISK_INODE))
    assert replies.last()[:2] == (errno.EPERM, 30)


@pytest.mark.parametrize(
    ("what", "data"),
    [
        ("length says more than was read", request(fp.GETATTR, 40, bytes(16))[:-4]),
        ("GETATTR body too short", request(fp.GETATTR, 40, bytes(8))),
        ("READ body too short", request(fp.READ, 40, bytes(20))),
        ("WRITE body too short", request(fp.WRITE, 40, bytes(24))),
        ("WRITE data shorter than its size", request(fp.WRITE, 40, fp.WRITE_IN.pack(
            1 << 4 | DISK_INODE, 0, 4096, 0, 0, 0, 0) + bytes(100))),
        ("INIT body too short", request(fp.INIT, 40, bytes(8))),
        ("LOOKUP name without NUL", request(fp.LOOKUP, 40, b"disk")),
        ("SETATTR body too short", request(fp.SETATTR, 40, bytes(40))),
        ("FALLOCATE body too short", request(fp.FALLOCATE, 40, bytes(16))),
    ],
)  # fmt: skip
def test_malformed_requests_get_einval(
    fs: BlockFile, replies: Replies, what: str, data: bytes
) -> None:
    if what.startswith("length"):
        # the header says 4 bytes more than were read
        fs.handle(bytearray(data), len(data))
    else:
        send(fs, data)
    assert replies.last()[:2] == (errno.EINVAL, 40), what
    assert fs.busy == 0


def test_unknown_and_unserved_requests_get_enosys(fs: BlockFile, replies: Replies) -> None:
    for opcode in (fp.ACCESS, 9, 47, 99999):  # ACCESS, MKDIR, COPY_FILE_RANGE, nonsense
        send(fs, request(opcode, 50 + opcode, bytes(64)))
        assert replies.last()[:2] == (errno.ENOSYS, 50 + opcode)


def test_a_request_without_a_whole_header_is_dropped(fs: BlockFile, replies: Replies) -> None:
    before = len(replies.written)
    fs.handle(bytearray(request(fp.GETATTR, 60)[:20]), 20)
    fs.handle(bytearray(), 0)
    assert len(replies.written) == before and fs.busy == 0


def test_forget_and_interrupt_get_no_reply(fs: BlockFile, replies: Replies) -> None:
    before = len(replies.written)
    send(fs, request(fp.FORGET, 70, struct.pack("=Q", 1), nodeid=DISK_INODE))
    send(fs, request(fp.BATCH_FORGET, 71, struct.pack("=II", 0, 0)))
    send(fs, request(fp.INTERRUPT, 72, struct.pack("=Q", 5)))
    assert len(replies.written) == before and fs.busy == 0


def test_bad_file_handles_get_ebadf(fs: BlockFile, replies: Replies) -> None:
    for fh in (0, 1, 5 << 4 | 9):  # no inode, the root, no such inode
        send(fs, request(fp.READ, 80, fp.READ_IN.pack(fh, 0, 4096, 0, 0, 0, 0)))
        assert replies.last()[:2] == (errno.EBADF, 80), fh


def test_statfs_says_the_export_size(fs: BlockFile, replies: Replies) -> None:
    send(fs, request(fp.STATFS, 90))
    error, _, body = replies.last()
    blocks, _, _, files, _, bsize, namelen, frsize, _ = fp.KSTATFS.unpack(body)
    assert error == 0 and (blocks, bsize, frsize, files) == ((1 << 30) // 4096, 4096, 4096, 3)
    assert namelen == 255


def test_a_refused_reply_does_not_end_the_loop(fs: BlockFile) -> None:
    def gone(data: bytes | bytearray) -> int:
        raise OSError(errno.ENOENT, "interrupted")

    fs._write = gone
    send(fs, request(fp.STATFS, 91))  # no exception
    assert fs.busy == 0


def test_invalidate_notification_layout() -> None:
    data = fp.notify_inval_inode(DISK_INODE)
    length, code, unique = fp.OUT_HEADER.unpack_from(data)
    assert (length, code, unique) == (len(data), fp.NOTIFY_INVAL_INODE, 0)
    assert fp.NOTIFY_INVAL_INODE_OUT.unpack_from(data, 16) == (DISK_INODE, -1, 0)

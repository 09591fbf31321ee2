"""The error value a reply carries depends on the command and its flags.

The NBD spec keeps ENOTSUP for a WRITE_ZEROES sent with FAST_ZERO and
EOVERFLOW for a READ sent with DF; any other command gets EINVAL for those
host errors.  Checked on the mapping itself, then end to end: a
Transmission over a socketpair, its image failing every call with the host
error, answers each command with the value the spec allows.
"""

from __future__ import annotations

import errno
import struct
from pathlib import Path

import pytest
import trio

from nbd import codec
from nbd.constants import (
    SIMPLE_REPLY_MAGIC,
    Command,
    CommandFlag,
    Errno,
    TransmissionFlag,
)
from nbd.exports import Export
from nbd.handshake import Session
from nbd.image import Image
from nbd.transmission import Transmission, wire_errno
from nbd.transport import Transport

COMMANDS = [
    Command.READ,
    Command.WRITE,
    Command.FLUSH,
    Command.TRIM,
    Command.CACHE,
    Command.WRITE_ZEROES,
    Command.BLOCK_STATUS,
]
# Every flag a command may carry, alone and together.
FLAG_SETS: dict[Command, list[int]] = {
    Command.READ: [0, CommandFlag.DF],
    Command.WRITE: [0, CommandFlag.FUA],
    Command.FLUSH: [0],
    Command.TRIM: [0, CommandFlag.FUA],
    Command.CACHE: [0],
    Command.WRITE_ZEROES: [
        0,
        CommandFlag.FUA,
        CommandFlag.NO_HOLE,
        CommandFlag.FAST_ZERO,
        CommandFlag.FAST_ZERO | CommandFlag.NO_HOLE | CommandFlag.FUA,
    ],
    Command.BLOCK_STATUS: [0, CommandFlag.REQ_ONE],
}
CASES = [(c, f) for c in COMMANDS for f in FLAG_SETS[c]]


def _expected(code: int, command: int, flags: int) -> Errno:
    if code == errno.EOPNOTSUPP:
        fast = command == Command.WRITE_ZEROES and flags & CommandFlag.FAST_ZERO
        return Errno.ENOTSUP if fast else Errno.EINVAL
    if code == errno.EOVERFLOW:
        df = command == Command.READ and flags & CommandFlag.DF
        return Errno.EOVERFLOW if df else Errno.EINVAL
    return {
        errno.EPERM: Errno.EPERM,
        errno.EACCES: Errno.EPERM,
        errno.EROFS: Errno.EPERM,
        errno.ENOSPC: Errno.ENOSPC,
        errno.EDQUOT: Errno.ENOSPC,
        errno.EFBIG: Errno.ENOSPC,
        errno.ENOMEM: Errno.ENOMEM,
        errno.EINVAL: Errno.EINVAL,
        errno.ESHUTDOWN: Errno.ESHUTDOWN,
    }.get(code, Errno.EIO)


@pytest.mark.parametrize(("command", "flags"), CASES)
def test_enotsup_only_for_fast_zero(command: Command, flags: int) -> None:
    got = wire_errno(OSError(errno.EOPNOTSUPP, "no"), command, flags)
    if command == Command.WRITE_ZEROES and flags & CommandFlag.FAST_ZERO:
        assert got == Errno.ENOTSUP
    else:
        assert got == Errno.EINVAL


@pytest.mark.parametrize(("command", "flags"), CASES)
def test_eoverflow_only_for_unfragmented_read(command: Command, flags: int) -> None:
    got = wire_errno(OSError(errno.EOVERFLOW, "too big"), command, flags)
    if command == Command.READ and flags & CommandFlag.DF:
        assert got == Errno.EOVERFLOW
    else:
        assert got == Errno.EINVAL


@pytest.mark.parametrize(("command", "flags"), CASES)
@pytest.mark.parametrize(
    ("host", "wire"),
    [
        (errno.EPERM, Errno.EPERM),
        (errno.EACCES, Errno.EPERM),
        (errno.EROFS, Errno.EPERM),
        (errno.ENOSPC, Errno.ENOSPC),
        (errno.EDQUOT, Errno.ENOSPC),
        (errno.EFBIG, Errno.ENOSPC),
        (errno.ENOMEM, Errno.ENOMEM),
        (errno.EINVAL, Errno.EINVAL),
        (errno.ESHUTDOWN, Errno.ESHUTDOWN),
        (errno.EIO, Errno.EIO),
        (errno.ENODEV, Errno.EIO),
        (errno.ENOSYS, Errno.EIO),
    ],
)
def test_other_errors_do_not_depend_on_the_command(
    command: Command, flags: int, host: int, wire: Errno
) -> None:
    assert wire_errno(OSError(host, "x"), command, flags) == wire


def test_an_oserror_without_errno_is_eio() -> None:
    assert wire_errno(OSError("no errno"), Command.READ, 0) == Errno.EIO


# ------------------------------------------------------------ end to end


class FailingImage(Image):
    """A real image whose every I/O call fails with one host error."""

    def __init__(self, path: Path, code: int) -> None:
        super().__init__(path, read_only=False)
        self.code = code

    def _fail(self, *args: object, **kwargs: object) -> None:
        raise OSError(self.code, "injected")

    read_nowait = read_into = write_inline = write = writev_timed = _fail  # type: ignore[assignment]
    flush = punch_hole = zero = advise_willneed = extents = _fail  # type: ignore[assignment]


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


async def _reply(sock: trio.socket.SocketType) -> tuple[int, int]:
    """(cookie, error) of the next reply, simple or the last chunk of a structured one."""

    async def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = await sock.recv(n - len(out))
            assert got, "server closed the connection"
            out += got
        return out

    while True:
        magic = struct.unpack(">I", await exact(4))[0]
        if magic == SIMPLE_REPLY_MAGIC:
            error, cookie = struct.unpack(">IQ", await exact(12))
            return cookie, error
        flags, type_, cookie, length = struct.unpack(">HHQI", await exact(16))
        body = await exact(length)
        if type_ & (1 << 15):
            return cookie, struct.unpack_from(">I", body)[0]
        if flags & 1:
            return cookie, 0


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EOVERFLOW, errno.EDQUOT, errno.EIO])
async def test_a_transmission_answers_each_command_as_the_spec_allows(
    tmp_path: Path, code: int
) -> None:
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(1024 * 1024))
    image = FailingImage(path, code)
    session = Session(
        export=Export("x", path),
        image=image,
        flags=TransmissionFlag.HAS_FLAGS,
        structured=True,
        base_allocation=True,
        tls=False,
    )
    ours, theirs = trio.socket.socketpair()
    tx = Transmission(Transport(trio.SocketStream(ours)), session, trio.CapacityLimiter(4), "test")
    requests: dict[int, tuple[Command, int]] = {}
    wire = bytearray()
    for command, flags in CASES:
        lengths = [4096, 256 * 1024] if command == Command.WRITE else [4096]
        for length in lengths:
            cookie = len(requests) + 1
            requests[cookie] = (command, flags)
            offset, size = (0, 0) if command == Command.FLUSH else (8192, length)
            wire += codec.encode_request(command, cookie, offset, size, flags)
            if command == Command.WRITE:
                wire += bytes(length)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            nursery.start_soon(_send_all, theirs, bytes(wire))
            answers = dict([await _reply(theirs) for _ in requests])
            await theirs.send(codec.encode_request(Command.DISC, 0, 0, 0))
    theirs.close()
    for cookie, (command, flags) in requests.items():
        want: int = _expected(code, command, flags)
        if command == Command.TRIM and code == errno.EOPNOTSUPP and not flags:
            # TRIM is advisory: a store without holes keeps the data (with
            # FUA, the flush after it fails, and that is what is answered).
            want = 0
        assert answers[cookie] == want, (command.name, flags, answers[cookie])

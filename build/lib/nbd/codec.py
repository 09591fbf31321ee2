"""Encoding and decoding of NBD messages.

Pure functions over bytes: no sockets, no files.  Both the server and the
client handshake use these, and they are property-tested on their own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from nbd.constants import (
    IHAVEOPT,
    MAX_STRING,
    NBDMAGIC,
    OPTION_REPLY_MAGIC,
    REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
    HandshakeFlag,
    Info,
    OptionReply,
    ReplyFlag,
    ReplyType,
)

GREETING = struct.Struct(">QQH")  # NBDMAGIC, IHAVEOPT, handshake flags
CLIENT_FLAGS = struct.Struct(">I")
OPTION_HEADER = struct.Struct(">QII")  # IHAVEOPT, option, length
OPTION_REPLY_HEADER = struct.Struct(">QIII")  # magic, option, reply type, length
EXPORT_NAME_REPLY = struct.Struct(">QH")  # size, transmission flags (+124 zeroes)
REQUEST = struct.Struct(">IHHQQI")  # magic, flags, type, cookie, offset, length
SIMPLE_REPLY = struct.Struct(">IIQ")  # magic, error, cookie
STRUCTURED_REPLY = struct.Struct(">IHHQI")  # magic, flags, type, cookie, length
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
EXTENT = struct.Struct(">II")  # length, flags

EXPORT_NAME_PADDING = bytes(124)


class ProtocolError(Exception):
    """The peer sent something the protocol does not allow."""


class OptionDataError(ProtocolError):
    """An option's payload is malformed; answered with NBD_REP_ERR_INVALID."""


@dataclass(frozen=True, slots=True)
class Request:
    flags: int
    type: int
    cookie: int
    offset: int
    length: int


# ---------------------------------------------------------------- handshake


def encode_greeting(flags: HandshakeFlag) -> bytes:
    return GREETING.pack(NBDMAGIC, IHAVEOPT, int(flags))


def decode_greeting(data: bytes) -> int:
    magic, opt, flags = GREETING.unpack(data)
    if magic != NBDMAGIC or opt != IHAVEOPT:
        raise ProtocolError("server is not a fixed-newstyle NBD server")
    return int(flags)


def decode_option_header(data: bytes) -> tuple[int, int]:
    """Return (option, length) from a 16-byte option header."""
    magic, option, length = OPTION_HEADER.unpack(data)
    if magic != IHAVEOPT:
        raise ProtocolError(f"bad option magic {magic:#x}")
    return option, length


def encode_option(option: int, data: bytes = b"") -> bytes:
    return OPTION_HEADER.pack(IHAVEOPT, option, len(data)) + data


def encode_option_reply(option: int, reply: OptionReply | int, data: bytes = b"") -> bytes:
    return OPTION_REPLY_HEADER.pack(OPTION_REPLY_MAGIC, option, int(reply), len(data)) + data


def decode_option_reply_header(data: bytes) -> tuple[int, int, int]:
    """Return (option, reply type, length) from a 20-byte option reply header."""
    magic, option, reply, length = OPTION_REPLY_HEADER.unpack(data)
    if magic != OPTION_REPLY_MAGIC:
        raise ProtocolError(f"bad option reply magic {magic:#x}")
    return option, reply, length


def _check_string(raw: bytes, what: str) -> str:
    if len(raw) > MAX_STRING:
        raise OptionDataError(f"{what} longer than {MAX_STRING} bytes")
    if b"\0" in raw:
        raise OptionDataError(f"{what} contains NUL")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OptionDataError(f"{what} is not UTF-8") from e


def encode_string32(s: str) -> bytes:
    raw = s.encode()
    return U32.pack(len(raw)) + raw


def decode_info_request(data: bytes) -> tuple[str, list[int]]:
    """Parse NBD_OPT_INFO/NBD_OPT_GO data: export name and requested info types."""
    if len(data) < 6:
        raise OptionDataError("INFO/GO data shorter than 6 bytes")
    (name_len,) = U32.unpack_from(data, 0)
    if name_len > len(data) - 6:
        raise OptionDataError("export name length exceeds option data")
    name = _check_string(data[4 : 4 + name_len], "export name")
    pos = 4 + name_len
    (count,) = U16.unpack_from(data, pos)
    pos += 2
    if len(data) - pos != 2 * count:
        raise OptionDataError("information request count does not match option length")
    infos = [U16.unpack_from(data, pos + 2 * i)[0] for i in range(count)]
    return name, infos


def encode_info_request(name: str, infos: list[int]) -> bytes:
    return encode_string32(name) + U16.pack(len(infos)) + b"".join(U16.pack(i) for i in infos)


def decode_export_name(data: bytes) -> str:
    return _check_string(data, "export name")


def decode_meta_context_request(data: bytes) -> tuple[str, list[str]]:
    """Parse LIST/SET_META_CONTEXT data: export name and queries."""
    if len(data) < 8:
        raise OptionDataError("meta context data shorter than 8 bytes")
    (name_len,) = U32.unpack_from(data, 0)
    if name_len > len(data) - 8:
        raise OptionDataError("export name length exceeds option data")
    name = _check_string(data[4 : 4 + name_len], "export name")
    pos = 4 + name_len
    (count,) = U32.unpack_from(data, pos)
    pos += 4
    queries: list[str] = []
    for _ in range(count):
        if len(data) - pos < 4:
            raise OptionDataError("truncated meta context query")
        (qlen,) = U32.unpack_from(data, pos)
        pos += 4
        if qlen > len(data) - pos:
            raise OptionDataError("meta context query length exceeds option data")
        queries.append(_check_string(data[pos : pos + qlen], "meta context query"))
        pos += qlen
    if pos != len(data):
        raise OptionDataError("trailing bytes after meta context queries")
    return name, queries


def encode_meta_context_request(name: str, queries: list[str]) -> bytes:
    return (
        encode_string32(name)
        + U32.pack(len(queries))
        + b"".join(encode_string32(q) for q in queries)
    )


def encode_info_export(size: int, flags: int) -> bytes:
    return U16.pack(Info.EXPORT) + U64.pack(size) + U16.pack(flags)


def encode_info_name(name: str) -> bytes:
    return U16.pack(Info.NAME) + name.encode()


def encode_info_description(description: str) -> bytes:
    return U16.pack(Info.DESCRIPTION) + description.encode()


def encode_info_block_size(minimum: int, preferred: int, maximum: int) -> bytes:
    return U16.pack(Info.BLOCK_SIZE) + struct.pack(">III", minimum, preferred, maximum)


def encode_server_entry(name: str, description: str = "") -> bytes:
    return encode_string32(name) + description.encode()


def encode_meta_context(context_id: int, name: str) -> bytes:
    return U32.pack(context_id) + name.encode()


def encode_export_name_reply(size: int, flags: int, no_zeroes: bool) -> bytes:
    reply = EXPORT_NAME_REPLY.pack(size, flags)
    return reply if no_zeroes else reply + EXPORT_NAME_PADDING


# ------------------------------------------------------------- transmission


def decode_request(data: bytes | bytearray | memoryview) -> Request:
    magic, flags, type_, cookie, offset, length = REQUEST.unpack(data)
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"bad request magic {magic:#x}")
    return Request(flags, type_, cookie, offset, length)


def encode_request(type_: int, cookie: int, offset: int, length: int, flags: int = 0) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, flags, type_, cookie, offset, length)


def encode_simple_reply(cookie: int, error: int = 0) -> bytes:
    return SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, error, cookie)


def encode_chunk_header(cookie: int, type_: ReplyType, length: int, done: bool) -> bytes:
    flags = ReplyFlag.DONE if done else 0
    return STRUCTURED_REPLY.pack(STRUCTURED_REPLY_MAGIC, int(flags), int(type_), cookie, length)


def encode_offset_data_header(cookie: int, offset: int, data_len: int, done: bool) -> bytes:
    """Header plus offset of an OFFSET_DATA chunk; the caller sends the data after it."""
    return encode_chunk_header(cookie, ReplyType.OFFSET_DATA, 8 + data_len, done) + U64.pack(offset)


def encode_offset_hole(cookie: int, offset: int, length: int, done: bool) -> bytes:
    return encode_chunk_header(cookie, ReplyType.OFFSET_HOLE, 12, done) + struct.pack(
        ">QI", offset, length
    )


def encode_none_chunk(cookie: int) -> bytes:
    return encode_chunk_header(cookie, ReplyType.NONE, 0, True)


def encode_error_chunk(cookie: int, error: int, message: str = "") -> bytes:
    raw = message.encode()[:MAX_STRING]
    body = struct.pack(">IH", error, len(raw)) + raw
    return encode_chunk_header(cookie, ReplyType.ERROR, len(body), True) + body


def encode_block_status(
    cookie: int, context_id: int, extents: list[tuple[int, int]], done: bool = True
) -> bytes:
    body = U32.pack(context_id) + b"".join(EXTENT.pack(length, flags) for length, flags in extents)
    return encode_chunk_header(cookie, ReplyType.BLOCK_STATUS, len(body), done) + body


def decode_simple_reply(data: bytes) -> tuple[int, int]:
    """Return (error, cookie)."""
    magic, error, cookie = SIMPLE_REPLY.unpack(data)
    if magic != SIMPLE_REPLY_MAGIC:
        raise ProtocolError(f"bad simple reply magic {magic:#x}")
    return error, cookie


def decode_chunk_header(data: bytes) -> tuple[int, int, int, int]:
    """Return (flags, type, cookie, length) of a structured reply chunk."""
    magic, flags, type_, cookie, length = STRUCTURED_REPLY.unpack(data)
    if magic != STRUCTURED_REPLY_MAGIC:
        raise ProtocolError(f"bad structured reply magic {magic:#x}")
    return flags, type_, cookie, length


def decode_block_status(body: bytes) -> tuple[int, list[tuple[int, int]]]:
    if len(body) < 4 or (len(body) - 4) % EXTENT.size:
        raise ProtocolError("malformed block status chunk")
    (context_id,) = U32.unpack_from(body, 0)
    extents = [EXTENT.unpack_from(body, pos) for pos in range(4, len(body), EXTENT.size)]
    return context_id, extents


__all__ = [
    "CLIENT_FLAGS",
    "GREETING",
    "OPTION_HEADER",
    "OPTION_REPLY_HEADER",
    "REQUEST",
    "SIMPLE_REPLY",
    "STRUCTURED_REPLY",
    "OptionDataError",
    "ProtocolError",
    "ReplyFlag",
    "ReplyType",
    "Request",
]

"""Property tests of nbd/codec.py: round trips, magic checks, hostile option data."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbd import codec
from nbd.codec import OptionDataError, ProtocolError
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

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)

# Strings the protocol allows: UTF-8 without NUL, at most 4096 bytes.
wire_text = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=64)
long_wire_text = st.text(
    st.characters(codec="utf-8", exclude_characters="\0"), min_size=1000, max_size=MAX_STRING
).filter(lambda s: len(s.encode()) <= MAX_STRING)
names = st.one_of(wire_text, long_wire_text)


def _wrong(magic: int, bits: int) -> st.SearchStrategy[int]:
    return st.integers(0, 2**bits - 1).filter(lambda m: m != magic)


# ------------------------------------------------------------- handshake


@given(st.sampled_from([0, 1, 2, 3]))
def test_greeting_round_trip(flags: int) -> None:
    data = codec.encode_greeting(HandshakeFlag(flags))
    assert len(data) == 18
    assert codec.decode_greeting(data) == flags


@given(_wrong(NBDMAGIC, 64), _wrong(IHAVEOPT, 64), u16)
def test_greeting_bad_magic(magic: int, opt_magic: int, flags: int) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_greeting(codec.GREETING.pack(magic, IHAVEOPT, flags))
    with pytest.raises(ProtocolError):
        codec.decode_greeting(codec.GREETING.pack(NBDMAGIC, opt_magic, flags))


@given(u32, st.binary(max_size=512))
def test_option_round_trip(option: int, data: bytes) -> None:
    encoded = codec.encode_option(option, data)
    assert codec.decode_option_header(encoded[:16]) == (option, len(data))
    assert encoded[16:] == data


@given(_wrong(IHAVEOPT, 64), u32, u32)
def test_option_header_bad_magic(magic: int, option: int, length: int) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_option_header(codec.OPTION_HEADER.pack(magic, option, length))


@given(u32, st.one_of(st.sampled_from(list(OptionReply)), u32), st.binary(max_size=512))
def test_option_reply_round_trip(option: int, reply: int, data: bytes) -> None:
    encoded = codec.encode_option_reply(option, reply, data)
    assert codec.decode_option_reply_header(encoded[:20]) == (option, int(reply), len(data))
    assert encoded[20:] == data


@given(_wrong(OPTION_REPLY_MAGIC, 64), u32, u32, u32)
def test_option_reply_bad_magic(magic: int, option: int, reply: int, length: int) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_option_reply_header(
            codec.OPTION_REPLY_HEADER.pack(magic, option, reply, length)
        )


@given(names, st.lists(u16, max_size=40))
def test_info_request_round_trip(name: str, infos: list[int]) -> None:
    assert codec.decode_info_request(codec.encode_info_request(name, infos)) == (name, infos)


@given(names, st.lists(st.one_of(wire_text, long_wire_text), max_size=6))
def test_meta_context_request_round_trip(name: str, queries: list[str]) -> None:
    data = codec.encode_meta_context_request(name, queries)
    assert codec.decode_meta_context_request(data) == (name, queries)


@given(names)
def test_export_name_round_trip(name: str) -> None:
    assert codec.decode_export_name(name.encode()) == name


@given(u64, u16)
def test_info_export_layout(size: int, flags: int) -> None:
    data = codec.encode_info_export(size, flags)
    assert struct.unpack(">HQH", data) == (Info.EXPORT, size, flags)


@given(u32, u32, u32)
def test_info_block_size_layout(minimum: int, preferred: int, maximum: int) -> None:
    data = codec.encode_info_block_size(minimum, preferred, maximum)
    assert struct.unpack(">HIII", data) == (Info.BLOCK_SIZE, minimum, preferred, maximum)


@given(wire_text, wire_text)
def test_info_name_description_and_server_entry(name: str, description: str) -> None:
    assert codec.encode_info_name(name) == struct.pack(">H", Info.NAME) + name.encode()
    assert (
        codec.encode_info_description(description)
        == struct.pack(">H", Info.DESCRIPTION) + description.encode()
    )
    entry = codec.encode_server_entry(name, description)
    (n,) = struct.unpack_from(">I", entry)
    assert entry[4 : 4 + n].decode() == name
    assert entry[4 + n :].decode() == description


@given(u32, wire_text)
def test_meta_context_reply_layout(context_id: int, name: str) -> None:
    data = codec.encode_meta_context(context_id, name)
    assert struct.unpack_from(">I", data) == (context_id,)
    assert data[4:].decode() == name


@given(u64, u16, st.booleans())
def test_export_name_reply(size: int, flags: int, no_zeroes: bool) -> None:
    data = codec.encode_export_name_reply(size, flags, no_zeroes)
    assert len(data) == (10 if no_zeroes else 134)
    assert struct.unpack_from(">QH", data) == (size, flags)
    assert data[10:] == bytes(len(data) - 10)


# ---------------------------------------------------------- transmission


@given(u16, u16, u64, u64, u32)
def test_request_round_trip(flags: int, type_: int, cookie: int, offset: int, length: int) -> None:
    data = codec.encode_request(type_, cookie, offset, length, flags)
    assert len(data) == 28
    assert codec.decode_request(data) == codec.Request(flags, type_, cookie, offset, length)
    assert codec.decode_request(bytearray(data)) == codec.decode_request(memoryview(data))


@given(_wrong(REQUEST_MAGIC, 32), u16, u16, u64, u64, u32)
def test_request_bad_magic(
    magic: int, flags: int, type_: int, cookie: int, offset: int, length: int
) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_request(codec.REQUEST.pack(magic, flags, type_, cookie, offset, length))


@given(u64, u32)
def test_simple_reply_round_trip(cookie: int, error: int) -> None:
    data = codec.encode_simple_reply(cookie, error)
    assert len(data) == 16
    assert codec.decode_simple_reply(data) == (error, cookie)


@given(_wrong(SIMPLE_REPLY_MAGIC, 32), u32, u64)
def test_simple_reply_bad_magic(magic: int, error: int, cookie: int) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_simple_reply(codec.SIMPLE_REPLY.pack(magic, error, cookie))


@given(u64, st.sampled_from(list(ReplyType)), u32, st.booleans())
def test_chunk_header_round_trip(cookie: int, type_: ReplyType, length: int, done: bool) -> None:
    data = codec.encode_chunk_header(cookie, type_, length, done)
    assert len(data) == 20
    flags = ReplyFlag.DONE if done else 0
    assert codec.decode_chunk_header(data) == (flags, type_, cookie, length)


@given(_wrong(STRUCTURED_REPLY_MAGIC, 32), u16, u16, u64, u32)
def test_chunk_header_bad_magic(magic: int, flags: int, type_: int, cookie: int, n: int) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_chunk_header(codec.STRUCTURED_REPLY.pack(magic, flags, type_, cookie, n))


@given(u64, u64, st.integers(0, 2**32 - 9), st.booleans())
def test_offset_data_header(cookie: int, offset: int, data_len: int, done: bool) -> None:
    data = codec.encode_offset_data_header(cookie, offset, data_len, done)
    flags, type_, got_cookie, length = codec.decode_chunk_header(data[:20])
    assert (type_, got_cookie, length) == (ReplyType.OFFSET_DATA, cookie, 8 + data_len)
    assert bool(flags & ReplyFlag.DONE) == done
    assert struct.unpack(">Q", data[20:]) == (offset,)


@given(u64, u64, u32, st.booleans())
def test_offset_hole(cookie: int, offset: int, hole_len: int, done: bool) -> None:
    data = codec.encode_offset_hole(cookie, offset, hole_len, done)
    flags, type_, got_cookie, length = codec.decode_chunk_header(data[:20])
    assert (type_, got_cookie, length) == (ReplyType.OFFSET_HOLE, cookie, 12)
    assert bool(flags & ReplyFlag.DONE) == done
    assert struct.unpack(">QI", data[20:]) == (offset, hole_len)


@given(u64)
def test_none_chunk(cookie: int) -> None:
    data = codec.encode_none_chunk(cookie)
    assert codec.decode_chunk_header(data) == (ReplyFlag.DONE, ReplyType.NONE, cookie, 0)


@given(u64, u32, st.one_of(wire_text, st.text(min_size=4000, max_size=5000)))
def test_error_chunk(cookie: int, error: int, message: str) -> None:
    data = codec.encode_error_chunk(cookie, error, message)
    flags, type_, got_cookie, length = codec.decode_chunk_header(data[:20])
    assert (flags, type_, got_cookie) == (ReplyFlag.DONE, ReplyType.ERROR, cookie)
    body = data[20:]
    assert len(body) == length
    got_error, msg_len = struct.unpack_from(">IH", body)
    assert got_error == error
    assert msg_len == len(body) - 6 <= MAX_STRING
    assert body[6:] == message.encode()[:MAX_STRING]


@given(u64, u32, st.lists(st.tuples(u32, u32), max_size=50), st.booleans())
def test_block_status_round_trip(
    cookie: int, context_id: int, extents: list[tuple[int, int]], done: bool
) -> None:
    data = codec.encode_block_status(cookie, context_id, extents, done)
    flags, type_, got_cookie, length = codec.decode_chunk_header(data[:20])
    assert (type_, got_cookie, length) == (ReplyType.BLOCK_STATUS, cookie, len(data) - 20)
    assert bool(flags & ReplyFlag.DONE) == done
    assert codec.decode_block_status(data[20:]) == (context_id, extents)


@given(st.binary(max_size=64).filter(lambda b: len(b) < 4 or (len(b) - 4) % 8))
def test_block_status_malformed(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_block_status(body)


# ------------------------------------------------------ hostile option data


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Near-valid data: truncated, extended, or with a byte changed."""
    n = len(valid)
    truncated = st.integers(0, max(n - 1, 0)).map(lambda k: valid[:k])
    extended = st.binary(min_size=1, max_size=16).map(lambda extra: valid + extra)
    flipped = st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, 255)).map(
        lambda p: valid[: p[0]] + bytes([p[1]]) + valid[p[0] + 1 :] if n else valid
    )
    return st.one_of(truncated, extended, flipped)


near_info_requests = st.builds(codec.encode_info_request, names, st.lists(u16, max_size=8)).flatmap(
    _mutations
)
near_meta_requests = st.builds(
    codec.encode_meta_context_request, names, st.lists(wire_text, max_size=4)
).flatmap(_mutations)
# A leading length field close to the number of bytes that follow it: where
# off-by-one errors in the bounds checks live.
skewed_lengths = st.tuples(st.binary(max_size=64), st.integers(-10, 10)).map(
    lambda t: struct.pack(">I", max(0, len(t[0]) + t[1])) + t[0]
)
hostile = st.one_of(
    st.binary(max_size=2 * MAX_STRING), near_info_requests, near_meta_requests, skewed_lengths
)


def _only_option_data_error(parse: Callable[[bytes], object], data: bytes) -> None:
    # Any other exception (struct.error, IndexError, UnicodeDecodeError, ...)
    # propagates and fails the test.
    with contextlib.suppress(OptionDataError):
        parse(data)


@given(hostile)
def test_fuzz_decode_info_request(data: bytes) -> None:
    _only_option_data_error(codec.decode_info_request, data)


@given(hostile)
def test_fuzz_decode_meta_context_request(data: bytes) -> None:
    _only_option_data_error(codec.decode_meta_context_request, data)


@given(hostile)
def test_fuzz_decode_export_name(data: bytes) -> None:
    _only_option_data_error(codec.decode_export_name, data)


@given(hostile)
def test_fuzz_successful_parses_are_consistent(data: bytes) -> None:
    """Whatever decodes re-encodes to the very same bytes (no lenient parsing)."""
    try:
        name, infos = codec.decode_info_request(data)
    except OptionDataError:
        pass
    else:
        assert codec.encode_info_request(name, infos) == data
    try:
        name, queries = codec.decode_meta_context_request(data)
    except OptionDataError:
        pass
    else:
        assert codec.encode_meta_context_request(name, queries) == data


def test_info_request_length_checks() -> None:
    for data in [
        b"",
        b"\0\0\0\0\0",  # shorter than 6 bytes
        struct.pack(">I", 1) + b"\0",  # name length past the end
        struct.pack(">I", 2**32 - 1) + b"ab",
        struct.pack(">IH", 0, 1),  # one info announced, none sent
        struct.pack(">IHH", 0, 0, 3),  # none announced, one sent
        struct.pack(">I", 1) + b"x" + struct.pack(">HHH", 1, 3, 2),  # 1 announced, 2 sent
    ]:
        with pytest.raises(OptionDataError):
            codec.decode_info_request(data)


def test_meta_context_request_length_checks() -> None:
    for data in [
        b"",
        struct.pack(">I", 0) + b"\0\0\0",  # shorter than 8 bytes
        struct.pack(">II", 1, 0),  # name length past the end (count eaten)
        struct.pack(">II", 0, 1),  # one query announced, none sent
        struct.pack(">III", 0, 1, 5) + b"base",  # query truncated
        struct.pack(">III", 0, 1, 2**32 - 1) + b"base",
        struct.pack(">II", 0, 2**32 - 1) + struct.pack(">I", 0),  # huge count
        struct.pack(">II", 0, 0) + b"x",  # trailing garbage
        struct.pack(">III", 0, 1, 1) + b"ab",  # trailing garbage after a query
    ]:
        with pytest.raises(OptionDataError):
            codec.decode_meta_context_request(data)


# ------------------------------------------------------------------ strings

BAD_STRINGS = {
    "nul": b"disk\0",
    "leading-nul": b"\0disk",
    "invalid-utf8": b"\xff\xfe",
    "truncated-utf8": "é".encode()[:1],
    "overlong-utf8": b"\xc0\x80",
    "surrogate-utf8": b"\xed\xa0\x80",
    "too-long": b"a" * (MAX_STRING + 1),
    "too-long-multibyte": "é".encode() * (MAX_STRING // 2 + 1),
}


def _in_info_request(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw + struct.pack(">H", 0)


def _in_meta_name(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw + struct.pack(">I", 0)


def _in_meta_query(raw: bytes) -> bytes:
    return struct.pack(">II", 0, 1) + struct.pack(">I", len(raw)) + raw


PLACES: dict[str, tuple[Callable[[bytes], object], Callable[[bytes], bytes]]] = {
    "export-name": (codec.decode_export_name, lambda raw: raw),
    "info-name": (codec.decode_info_request, _in_info_request),
    "meta-name": (codec.decode_meta_context_request, _in_meta_name),
    "meta-query": (codec.decode_meta_context_request, _in_meta_query),
}


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("bad", sorted(BAD_STRINGS))
def test_bad_strings_rejected(place: str, bad: str) -> None:
    parse, wrap = PLACES[place]
    with pytest.raises(OptionDataError):
        parse(wrap(BAD_STRINGS[bad]))


@pytest.mark.parametrize("place", sorted(PLACES))
def test_longest_string_accepted(place: str) -> None:
    parse, wrap = PLACES[place]
    parse(wrap(b"a" * MAX_STRING))
    parse(wrap("é".encode() * (MAX_STRING // 2)))


@given(
    st.binary(min_size=1, max_size=64).filter(lambda b: b"\0" in b),
    st.sampled_from(sorted(PLACES)),
)
def test_any_nul_rejected(raw: bytes, place: str) -> None:
    parse, wrap = PLACES[place]
    with pytest.raises(OptionDataError):
        parse(wrap(raw))


@given(st.binary(max_size=64), st.sampled_from(sorted(PLACES)))
def test_strings_accepted_iff_valid_utf8_without_nul(raw: bytes, place: str) -> None:
    parse, wrap = PLACES[place]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        valid = False
    else:
        valid = "\0" not in text
    if valid:
        parse(wrap(raw))
    else:
        with pytest.raises(OptionDataError):
            parse(wrap(raw))


def test_option_data_error_is_a_protocol_error() -> None:
    assert issubclass(OptionDataError, ProtocolError)

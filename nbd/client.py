"""Client side of the fixed-newstyle handshake, blocking, over a plain socket.

Its job is to negotiate an export and leave a socket in transmission phase,
typically to hand it to the kernel's nbd driver (``nbd.kernel``).  The kernel
speaks simple replies only and no extended headers, so neither structured
replies nor meta contexts are ever negotiated here.

TLS: ``NBD_OPT_STARTTLS`` is supported, and the socket then returned is an
``ssl.SSLSocket``.  That socket is for userspace use only: the kernel's nbd
driver cannot speak TLS (it would read TLS records as NBD replies), so
``nbd.kernel.attach_kernel`` refuses it.  Putting a TLS export behind a kernel
device needs a userspace TLS proxy (what ``nbd-client`` does), which moorage
does not have.

``connect_uri`` takes an NBD URI, parsed by ``nbd.uri``.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Literal

from nbd import codec
from nbd.codec import ProtocolError
from nbd.constants import (
    MAX_OPTION_LENGTH,
    MAX_STRING,
    NBDMAGIC,
    ClientFlag,
    HandshakeFlag,
    Info,
    Option,
    OptionReply,
    TransmissionFlag,
)
from nbd.uri import parse_nbd_uri

# The second magic of an oldstyle greeting ("cliserv_magic").
_OLDSTYLE_MAGIC = 0x00420281861253
_INFO_BLOCK_SIZE = struct.Struct(">III")
_INFO_EXPORT = struct.Struct(">QH")
_REP_ERR = 1 << 31  # set in every NBD_REP_ERR_* reply type


class HandshakeError(Exception):
    """The handshake failed: the server refused, or spoke something other than NBD.

    ``reply`` is the server's option reply when it sent one (``ERR_UNKNOWN``,
    ``ERR_TLS_REQD``, ...), so callers can map refusals without parsing text.
    """

    def __init__(self, message: str, reply: OptionReply | None = None) -> None:
        super().__init__(message)
        self.reply = reply


@dataclass(frozen=True, slots=True)
class BlockSize:
    """``NBD_INFO_BLOCK_SIZE`` as the server advertised it."""

    minimum: int
    preferred: int
    maximum: int


@dataclass(frozen=True, slots=True)
class Negotiated:
    """An export negotiated on ``sock``, which is now in transmission phase."""

    sock: socket.socket
    export_name: str
    size: int
    transmission_flags: TransmissionFlag
    # None when the server did not send NBD_INFO_BLOCK_SIZE (or EXPORT_NAME was used).
    block_size: BlockSize | None
    tls: bool
    # Which option entered transmission.
    via: Literal["go", "export_name"] = "go"
    description: str = ""

    @property
    def read_only(self) -> bool:
        return bool(self.transmission_flags & TransmissionFlag.READ_ONLY)


# ------------------------------------------------------------ socket I/O


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise HandshakeError(f"server closed the connection while sending {what}")
        got += k
    return bytes(buf)


def _send_option(sock: socket.socket, option: Option, data: bytes = b"") -> None:
    sock.sendall(codec.encode_option(option, data))


def _recv_option_reply(sock: socket.socket, option: Option) -> tuple[int, bytes]:
    """Read one option reply to ``option``; return (reply type, data)."""
    try:
        echoed, reply, length = codec.decode_option_reply_header(
            _recv_exact(sock, codec.OPTION_REPLY_HEADER.size, f"the reply to {option.name}")
        )
    except ProtocolError as e:
        raise HandshakeError(f"bad reply to NBD_OPT_{option.name}: {e}") from e
    if echoed != option:
        raise HandshakeError(f"server answered option {echoed} to NBD_OPT_{option.name}")
    if length > MAX_OPTION_LENGTH:
        raise HandshakeError(f"reply to NBD_OPT_{option.name} of {length} bytes is too large")
    data = _recv_exact(sock, length, f"the reply to {option.name}") if length else b""
    return reply, data


def _abort(sock: socket.socket) -> None:
    """Soft disconnect (NBD_OPT_ABORT), best effort: the session is failing anyway."""
    with contextlib.suppress(OSError):
        _send_option(sock, Option.ABORT)


def _known_reply(reply: int) -> OptionReply | None:
    try:
        return OptionReply(reply)
    except ValueError:
        return None


def _reply_name(reply: int) -> str:
    known = _known_reply(reply)
    return f"NBD_REP_{known.name}" if known is not None else f"reply type {reply:#x}"


def _refusal(option: Option, export: str, reply: int, data: bytes) -> HandshakeError:
    message = data.decode("utf-8", "replace")
    detail = f" ({message})" if message else ""
    name = _reply_name(reply)
    known = _known_reply(reply)
    match known:
        case OptionReply.ERR_UNKNOWN:
            text = f"unknown export {export!r}: the server has no such export or hides it"
        case OptionReply.ERR_TLS_REQD:
            text = f"the server requires TLS for export {export!r}; connect with a TLS context"
        case OptionReply.ERR_POLICY:
            text = f"the server's policy refuses export {export!r}"
        case OptionReply.ERR_SHUTDOWN:
            text = "the server is shutting down"
        case OptionReply.ERR_BLOCK_SIZE_REQD:
            text = "the server requires block size negotiation"
        case _:
            text = f"NBD_OPT_{option.name} for export {export!r} failed"
    return HandshakeError(f"{text} [{name}]{detail}", reply=known)


# --------------------------------------------------------------- handshake


def _greeting(sock: socket.socket) -> HandshakeFlag:
    raw = _recv_exact(sock, codec.GREETING.size, "its greeting")
    magic, second, flags = codec.GREETING.unpack(raw)
    if magic == NBDMAGIC and second == _OLDSTYLE_MAGIC:
        raise HandshakeError("server uses the oldstyle handshake, which is not supported")
    try:
        codec.decode_greeting(raw)
    except ProtocolError as e:
        raise HandshakeError(f"bad magic in the server greeting: {raw[:16].hex()} ({e})") from e
    return HandshakeFlag(flags)


def _starttls(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    server_hostname: str | None,
    required: bool,
) -> ssl.SSLSocket | None:
    """Upgrade to TLS; None if the server declined and TLS is optional."""
    _send_option(sock, Option.STARTTLS)
    reply, data = _recv_option_reply(sock, Option.STARTTLS)
    if reply != OptionReply.ACK:
        if reply & _REP_ERR and not required:
            return None
        _abort(sock)
        if reply & _REP_ERR:
            message = data.decode("utf-8", "replace")
            raise HandshakeError(
                f"TLS is required but the server refused NBD_OPT_STARTTLS "
                f"[{_reply_name(reply)}] {message}".rstrip(),
                reply=_known_reply(reply),
            )
        raise HandshakeError(f"unexpected {_reply_name(reply)} to NBD_OPT_STARTTLS")
    try:
        return ctx.wrap_socket(sock, server_side=False, server_hostname=server_hostname)
    except (ssl.SSLError, ssl.CertificateError) as e:
        # Too late to continue without TLS; the caller closes the socket.
        raise HandshakeError(f"TLS handshake with the server failed: {e}") from e
    except ValueError as e:  # check_hostname without a server_hostname
        raise HandshakeError(f"cannot start TLS: {e}") from e


@dataclass
class _GoInfo:
    size: int | None = None
    flags: int = 0
    block_size: BlockSize | None = None
    description: str = ""


def _parse_info(data: bytes, into: _GoInfo) -> None:
    if len(data) < 2:
        raise HandshakeError("NBD_REP_INFO shorter than 2 bytes")
    (kind,) = codec.U16.unpack_from(data, 0)
    body = data[2:]
    if kind == Info.EXPORT:
        if len(body) != _INFO_EXPORT.size:
            raise HandshakeError(f"NBD_INFO_EXPORT of {len(data)} bytes (expected 12)")
        into.size, into.flags = _INFO_EXPORT.unpack(body)
    elif kind == Info.BLOCK_SIZE:
        if len(body) != _INFO_BLOCK_SIZE.size:
            raise HandshakeError(f"NBD_INFO_BLOCK_SIZE of {len(data)} bytes (expected 14)")
        minimum, preferred, maximum = _INFO_BLOCK_SIZE.unpack(body)
        if minimum == 0 or minimum & (minimum - 1) or minimum > 65536:
            raise HandshakeError(f"invalid minimum block size {minimum}")
        if preferred & (preferred - 1) or preferred < max(minimum, 512):
            raise HandshakeError(f"invalid preferred block size {preferred}")
        into.block_size = BlockSize(minimum, preferred, maximum)
    elif kind == Info.DESCRIPTION:
        into.description = body.decode("utf-8", "replace")
    # NBD_INFO_NAME and unknown information types are ignored, as the spec allows.


def _go(sock: socket.socket, export: str) -> _GoInfo | None:
    """NBD_OPT_GO with an NBD_INFO_BLOCK_SIZE request; None if the server lacks GO."""
    _send_option(sock, Option.GO, codec.encode_info_request(export, [Info.BLOCK_SIZE]))
    info = _GoInfo()
    while True:
        reply, data = _recv_option_reply(sock, Option.GO)
        if reply == OptionReply.INFO:
            _parse_info(data, info)
        elif reply == OptionReply.ACK:
            if info.size is None:
                raise HandshakeError("server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT")
            return info
        elif reply == OptionReply.ERR_UNSUP:
            return None
        elif reply & _REP_ERR:
            _abort(sock)
            raise _refusal(Option.GO, export, reply, data)
        else:
            _abort(sock)
            raise HandshakeError(f"unexpected {_reply_name(reply)} to NBD_OPT_GO")


def _export_name(sock: socket.socket, export: str, no_zeroes: bool) -> tuple[int, int]:
    _send_option(sock, Option.EXPORT_NAME, export.encode())
    try:
        raw = _recv_exact(sock, codec.EXPORT_NAME_REPLY.size, "the export size and flags")
    except HandshakeError as e:
        # With EXPORT_NAME the only way a server can refuse is to hang up.
        raise HandshakeError(
            f"server closed the connection after NBD_OPT_EXPORT_NAME: "
            f"unknown export {export!r}, or access denied"
        ) from e
    if not no_zeroes:
        _recv_exact(sock, len(codec.EXPORT_NAME_PADDING), "the export reply padding")
    size, flags = codec.EXPORT_NAME_REPLY.unpack(raw)
    return int(size), int(flags)


def handshake(
    sock: socket.socket,
    export_name: str,
    *,
    tls_context: ssl.SSLContext | None = None,
    tls_required: bool = False,
    server_hostname: str | None = None,
) -> Negotiated:
    """Negotiate ``export_name`` on a connected socket and enter transmission.

    With ``tls_context`` the session is upgraded with NBD_OPT_STARTTLS first;
    ``tls_required`` makes a server that declines TLS an error (otherwise the
    session goes on in clear text).  On failure the server is sent
    NBD_OPT_ABORT where the protocol allows it; closing ``sock`` is the
    caller's job, except once TLS started: ``wrap_socket`` took the descriptor
    over, so the TLS socket is closed here.  Socket errors (timeouts, resets)
    propagate as ``OSError``.
    """
    if tls_required and tls_context is None:
        raise ValueError("tls_required needs a tls_context")
    raw_name = export_name.encode()
    if len(raw_name) > MAX_STRING or "\0" in export_name:
        raise ValueError(f"invalid export name {export_name!r}")
    server_flags = _greeting(sock)
    fixed = bool(server_flags & HandshakeFlag.FIXED_NEWSTYLE)
    no_zeroes = bool(server_flags & HandshakeFlag.NO_ZEROES)
    client_flags = ClientFlag(0)
    if fixed:
        client_flags |= ClientFlag.FIXED_NEWSTYLE
    if no_zeroes:
        client_flags |= ClientFlag.NO_ZEROES
    sock.sendall(codec.CLIENT_FLAGS.pack(int(client_flags)))

    if not fixed:
        # Plain newstyle: EXPORT_NAME is the only option there is.
        if tls_required:
            raise HandshakeError("TLS is required but the server is not fixed-newstyle")
        size, flags = _export_name(sock, export_name, no_zeroes)
        return Negotiated(
            sock, export_name, size, TransmissionFlag(flags), None, False, "export_name"
        )

    tls = False
    if tls_context is not None:
        wrapped = _starttls(sock, tls_context, server_hostname, tls_required)
        if wrapped is not None:
            sock, tls = wrapped, True
    via: Literal["go", "export_name"] = "go"
    try:
        info = _go(sock, export_name)
        if info is None:
            size, flags = _export_name(sock, export_name, no_zeroes)
            info, via = _GoInfo(size=size, flags=flags), "export_name"
    except BaseException:
        if tls:
            # The caller's socket object was detached by wrap_socket; only we can close.
            sock.close()
        raise
    assert info.size is not None
    return Negotiated(
        sock=sock,
        export_name=export_name,
        size=info.size,
        transmission_flags=TransmissionFlag(info.flags),
        block_size=info.block_size,
        tls=tls,
        via=via,
        description=info.description,
    )


def connect(
    host: str,
    port: int,
    export_name: str,
    timeout: float = 30.0,
    *,
    tls_context: ssl.SSLContext | None = None,
    tls_required: bool = False,
) -> Negotiated:
    """Connect over TCP (TCP_NODELAY), negotiate ``export_name``.

    ``timeout`` bounds the connect and the handshake; the returned socket is
    blocking, with no timeout, as the kernel and long-lived users expect.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        negotiated = handshake(
            sock,
            export_name,
            tls_context=tls_context,
            tls_required=tls_required,
            server_hostname=host,
        )
    except BaseException:
        sock.close()
        raise
    negotiated.sock.settimeout(None)
    return negotiated


def connect_unix(
    path: str,
    export_name: str,
    timeout: float = 30.0,
    *,
    tls_context: ssl.SSLContext | None = None,
    tls_required: bool = False,
    server_hostname: str | None = None,
) -> Negotiated:
    """Connect to a unix socket and negotiate ``export_name``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        negotiated = handshake(
            sock,
            export_name,
            tls_context=tls_context,
            tls_required=tls_required,
            server_hostname=server_hostname,
        )
    except BaseException:
        sock.close()
        raise
    negotiated.sock.settimeout(None)
    return negotiated


def connect_uri(
    uri: str, timeout: float = 30.0, *, tls_context: ssl.SSLContext | None = None
) -> Negotiated:
    """Connect to an NBD URI; ``nbds`` schemes require TLS and so a ``tls_context``."""
    parsed = parse_nbd_uri(uri)
    if parsed.tls and tls_context is None:
        raise ValueError(f"{uri!r} requires TLS: pass a tls_context")
    if parsed.socket_path is not None:
        return connect_unix(
            parsed.socket_path,
            parsed.export_name,
            timeout,
            tls_context=tls_context,
            tls_required=parsed.tls,
        )
    assert parsed.host is not None
    return connect(
        parsed.host,
        parsed.port,
        parsed.export_name,
        timeout,
        tls_context=tls_context,
        tls_required=parsed.tls,
    )


__all__ = [
    "BlockSize",
    "HandshakeError",
    "Negotiated",
    "connect",
    "connect_unix",
    "connect_uri",
    "handshake",
]

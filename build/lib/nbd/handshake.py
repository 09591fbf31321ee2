"""Server side of the fixed-newstyle handshake (option haggling).

Ends either with a negotiated session ready for transmission, or with the
client gone.  Option errors are answered with the protocol's own replies and
the haggling goes on; only violations the spec calls fatal disconnect.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from dataclasses import dataclass, field

import trio

from nbd import codec
from nbd.codec import OptionDataError, ProtocolError
from nbd.constants import (
    BASE_ALLOCATION,
    MAX_OPTION_LENGTH,
    MAX_PAYLOAD,
    PREFERRED_BLOCK,
    ClientFlag,
    HandshakeFlag,
    Info,
    Option,
    OptionReply,
    TransmissionFlag,
)
from nbd.exports import Export, ExportTable, IPAddress
from nbd.image import Image
from nbd.transport import PeerClosed, Transport

log = logging.getLogger("moorage.nbd")

BASE_ALLOCATION_ID = 1
SERVER_HANDSHAKE_FLAGS = HandshakeFlag.FIXED_NEWSTYLE | HandshakeFlag.NO_ZEROES
_KNOWN_CLIENT_FLAGS = ClientFlag.FIXED_NEWSTYLE | ClientFlag.NO_ZEROES


class ClientGone(Exception):
    """The client ended the handshake (ABORT, or a fatal violation)."""


@dataclass
class Session:
    """What the handshake negotiated; transmission runs on it."""

    export: Export
    image: Image
    flags: TransmissionFlag
    structured: bool
    base_allocation: bool
    tls: bool


@dataclass
class HandshakePolicy:
    tls_context: ssl.SSLContext | None = None
    tls_required: bool = False
    shutting_down: bool = False


@dataclass
class _State:
    tls: bool = False
    structured: bool = False
    meta_export: str | None = None
    meta_ids: list[int] = field(default_factory=list)


def transmission_flags(export: Export, structured: bool) -> TransmissionFlag:
    flags = (
        TransmissionFlag.HAS_FLAGS
        | TransmissionFlag.SEND_FLUSH
        | TransmissionFlag.CAN_MULTI_CONN
        | TransmissionFlag.SEND_CACHE
    )
    if structured:
        flags |= TransmissionFlag.SEND_DF
    if export.read_only:
        flags |= TransmissionFlag.READ_ONLY
    else:
        flags |= (
            TransmissionFlag.SEND_FUA
            | TransmissionFlag.SEND_TRIM
            | TransmissionFlag.SEND_WRITE_ZEROES
            | TransmissionFlag.SEND_FAST_ZERO
        )
    return flags


class Handshake:
    def __init__(
        self,
        transport: Transport,
        table: ExportTable,
        policy: HandshakePolicy,
        peer: IPAddress | None,
        peer_label: str,
    ) -> None:
        self.t = transport
        self.table = table
        self.policy = policy
        self.peer = peer
        self.label = peer_label
        self.state = _State()

    async def _reply(self, option: int, reply: OptionReply, data: bytes = b"") -> None:
        await self.t.send([codec.encode_option_reply(option, reply, data)])

    async def _error(self, option: int, reply: OptionReply, message: str) -> None:
        log.debug("%s: option %d: %s: %s", self.label, option, reply.name, message)
        await self._reply(option, reply, message.encode()[:4096])

    def _resolve(self, name: str) -> Export | None:
        if name == "":
            # The default export: the only one this client may see, if unique.
            visible = self.table.visible_to(self.peer)
            return visible[0] if len(visible) == 1 else None
        return self.table.lookup(name, self.peer)

    async def run(self) -> Session:
        await self.t.send([codec.encode_greeting(SERVER_HANDSHAKE_FLAGS)])
        (client_flags,) = codec.CLIENT_FLAGS.unpack(await self.t.recv_exact(4))
        if client_flags & ~int(_KNOWN_CLIENT_FLAGS):
            raise ProtocolError(f"unknown client flags {client_flags:#x}")
        if not client_flags & ClientFlag.FIXED_NEWSTYLE:
            raise ProtocolError("client does not support fixed newstyle")
        no_zeroes = bool(client_flags & ClientFlag.NO_ZEROES)
        while True:
            option, length = codec.decode_option_header(await self.t.recv_exact(16))
            if length > MAX_OPTION_LENGTH:
                raise ProtocolError(f"option {option} payload of {length} bytes is too large")
            data = await self.t.recv_exact(length) if length else b""
            session = await self._option(option, data, no_zeroes)
            if session is not None:
                return session

    async def _option(self, option: int, data: bytes, no_zeroes: bool) -> Session | None:
        st = self.state
        if option == Option.ABORT:
            # The client may already be gone: it asked to leave.
            with contextlib.suppress(PeerClosed):
                await self._reply(option, OptionReply.ACK)
            raise ClientGone("client sent NBD_OPT_ABORT")
        if self.policy.shutting_down:
            if option == Option.EXPORT_NAME:
                raise ClientGone("server shutting down")
            await self._error(option, OptionReply.ERR_SHUTDOWN, "server is shutting down")
            return None
        if self.policy.tls_required and not st.tls and option != Option.STARTTLS:
            if option == Option.EXPORT_NAME:
                raise ClientGone("NBD_OPT_EXPORT_NAME before STARTTLS on a TLS-only server")
            await self._error(option, OptionReply.ERR_TLS_REQD, "TLS is required")
            return None
        try:
            match option:
                case Option.EXPORT_NAME:
                    return await self._export_name(data, no_zeroes)
                case Option.LIST:
                    await self._list(data)
                case Option.STARTTLS:
                    await self._starttls(data)
                case Option.INFO | Option.GO:
                    return await self._info_go(option, data)
                case Option.STRUCTURED_REPLY:
                    if data:
                        raise OptionDataError("STRUCTURED_REPLY takes no data")
                    st.structured = True
                    await self._reply(option, OptionReply.ACK)
                case Option.LIST_META_CONTEXT | Option.SET_META_CONTEXT:
                    await self._meta_context(option, data)
                case _:
                    await self._error(option, OptionReply.ERR_UNSUP, f"option {option} unsupported")
        except OptionDataError as e:
            await self._error(option, OptionReply.ERR_INVALID, str(e))
        return None

    async def _export_name(self, data: bytes, no_zeroes: bool) -> Session:
        try:
            name = codec.decode_export_name(data)
        except OptionDataError as e:
            raise ClientGone(f"bad NBD_OPT_EXPORT_NAME: {e}") from e
        export = self._resolve(name)
        if export is None:
            raise ClientGone(f"unknown export {name!r}")
        if export.tls_required and not self.state.tls:
            raise ClientGone(f"export {name!r} requires TLS")
        try:
            image = Image(export.path, export.read_only)
        except OSError as e:
            raise ClientGone(f"cannot open image of {name!r}: {e}") from e
        session = self._session(export, image)
        await self.t.send([codec.encode_export_name_reply(image.size, session.flags, no_zeroes)])
        return session

    def _session(self, export: Export, image: Image) -> Session:
        st = self.state
        return Session(
            export=export,
            image=image,
            flags=transmission_flags(export, st.structured),
            structured=st.structured,
            base_allocation=st.meta_export == export.name and BASE_ALLOCATION_ID in st.meta_ids,
            tls=st.tls,
        )

    async def _list(self, data: bytes) -> None:
        if data:
            raise OptionDataError("LIST takes no data")
        for export in self.table.visible_to(self.peer):
            entry = codec.encode_server_entry(export.name, export.description)
            await self._reply(Option.LIST, OptionReply.SERVER, entry)
        await self._reply(Option.LIST, OptionReply.ACK)

    async def _starttls(self, data: bytes) -> None:
        ctx = self.policy.tls_context
        if ctx is None:
            await self._error(Option.STARTTLS, OptionReply.ERR_UNSUP, "TLS is not configured")
            return
        if data:
            raise OptionDataError("STARTTLS takes no data")
        if self.state.tls:
            raise OptionDataError("TLS is already active")
        await self._reply(Option.STARTTLS, OptionReply.ACK)
        tls_stream = trio.SSLStream(self.t.stream, ctx, server_side=True)
        try:
            await tls_stream.do_handshake()
        except (trio.BrokenResourceError, ssl.SSLError) as e:
            cause = e.__cause__ or e  # trio wraps the ssl error; its text is in the cause
            raise ClientGone(f"TLS handshake failed: {cause!r}") from e
        self.t.set_stream(tls_stream)
        # Nothing negotiated in clear text carries over into the TLS session.
        self.state = _State(tls=True)

    async def _info_go(self, option: int, data: bytes) -> Session | None:
        name, infos = codec.decode_info_request(data)
        export = self._resolve(name)
        if export is None:
            await self._error(option, OptionReply.ERR_UNKNOWN, f"no export named {name!r}")
            return None
        if export.tls_required and not self.state.tls:
            await self._error(option, OptionReply.ERR_TLS_REQD, "this export requires TLS")
            return None
        try:
            image = Image(export.path, export.read_only)
        except OSError as e:
            log.warning("%s: cannot open image of export %s: %s", self.label, export.name, e)
            await self._error(option, OptionReply.ERR_UNKNOWN, "export image unavailable")
            return None
        try:
            session = self._session(export, image)
            replies = [codec.encode_info_export(image.size, session.flags)]
            if Info.NAME in infos:
                replies.append(codec.encode_info_name(export.name))
            if Info.DESCRIPTION in infos and export.description:
                replies.append(codec.encode_info_description(export.description))
            replies.append(
                codec.encode_info_block_size(
                    export.min_block_size, max(PREFERRED_BLOCK, export.min_block_size), MAX_PAYLOAD
                )
            )
            for body in replies:
                await self._reply(option, OptionReply.INFO, body)
            await self._reply(option, OptionReply.ACK)
        except BaseException:
            image.close()
            raise
        if option == Option.GO:
            return session
        image.close()
        return None

    async def _meta_context(self, option: int, data: bytes) -> None:
        st = self.state
        name, queries = codec.decode_meta_context_request(data)
        if option == Option.SET_META_CONTEXT and not st.structured:
            raise OptionDataError("SET_META_CONTEXT needs structured replies first")
        export = self._resolve(name)
        if export is None:
            await self._error(option, OptionReply.ERR_UNKNOWN, f"no export named {name!r}")
            return
        listing = option == Option.LIST_META_CONTEXT
        matched = listing and not queries
        for q in queries:
            # "base:" is a wildcard for LIST only; SET MUST ignore it.
            if q == BASE_ALLOCATION or (listing and q == "base:"):
                matched = True
        if option == Option.SET_META_CONTEXT:
            # The export, not the name: "" (the default export) and its real
            # name select the same one in NBD_OPT_GO.
            st.meta_export = export.name
            st.meta_ids = [BASE_ALLOCATION_ID] if matched else []
        if matched:
            await self._reply(
                option,
                OptionReply.META_CONTEXT,
                codec.encode_meta_context(BASE_ALLOCATION_ID, BASE_ALLOCATION),
            )
        await self._reply(option, OptionReply.ACK)

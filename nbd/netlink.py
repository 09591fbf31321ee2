"""Generic netlink messages as bytes: the codec moorage speaks to the kernel's nbd driver.

Framing (``nlmsghdr``) and attributes (``nlattr``, nested or not), the
controller's CTRL_CMD_GETFAMILY, and the nbd family's commands and replies
(``linux/nbd-netlink.h``).  Pure functions over bytes, so every encoding is
testable without a socket or the nbd module; the socket is
``nbd.netlink_socket``, the attach that uses both ``nbd.kernel``.
Netlink is host byte order (``=`` in the struct formats).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nbd.kernel_errors import KernelNBDError

# ----------------------------------------------- uapi values (kernel headers)
# Hard-coded so nothing needs the headers at run time; tests/unit/test_nbd_netlink.py
# checks each against /usr/include/linux/*.h.

# linux/netlink.h
NETLINK_GENERIC = 16
NLM_F_REQUEST = 0x01
NLM_F_MULTI = 0x02
NLM_F_ACK = 0x04
NLM_F_ROOT = 0x100
NLM_F_MATCH = 0x200
NLM_F_DUMP = NLM_F_ROOT | NLM_F_MATCH
NLM_F_CAPPED = 0x100  # flags of an NLMSG_ERROR: the request was not echoed
NLM_F_ACK_TLVS = 0x200  # flags of an NLMSG_ERROR: extended ack attributes follow
NLMSG_NOOP = 0x1
NLMSG_ERROR = 0x2
NLMSG_DONE = 0x3
NLMSG_OVERRUN = 0x4
NLMSG_MIN_TYPE = 0x10
NLMSG_ALIGNTO = 4
NLA_ALIGNTO = 4
NLA_F_NESTED = 1 << 15
NLA_F_NET_BYTEORDER = 1 << 14
NLA_TYPE_MASK = 0xFFFF & ~(NLA_F_NESTED | NLA_F_NET_BYTEORDER)
NETLINK_ADD_MEMBERSHIP = 1
NETLINK_DROP_MEMBERSHIP = 2
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NLMSGERR_ATTR_MSG = 1
# <bits/socket.h> (glibc); not in the Python socket module.
SOL_NETLINK = 270

# linux/genetlink.h
GENL_ID_CTRL = NLMSG_MIN_TYPE
CTRL_CMD_NEWFAMILY = 1
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
CTRL_ATTR_VERSION = 3
CTRL_ATTR_HDRSIZE = 4
CTRL_ATTR_MAXATTR = 5
CTRL_ATTR_OPS = 6
CTRL_ATTR_MCAST_GROUPS = 7
CTRL_ATTR_MCAST_GRP_NAME = 1
CTRL_ATTR_MCAST_GRP_ID = 2
# The version libnl and iproute2 send with controller requests.
CTRL_VERSION = 1

# linux/nbd-netlink.h
NBD_GENL_FAMILY_NAME = "nbd"
NBD_GENL_VERSION = 0x1
NBD_GENL_MCAST_GROUP_NAME = "nbd_mc_group"
NBD_ATTR_UNSPEC = 0
NBD_ATTR_INDEX = 1  # u32
NBD_ATTR_SIZE_BYTES = 2  # u64
NBD_ATTR_BLOCK_SIZE_BYTES = 3  # u64
NBD_ATTR_TIMEOUT = 4  # u64, seconds
NBD_ATTR_SERVER_FLAGS = 5  # u64, the handshake's transmission flags
NBD_ATTR_CLIENT_FLAGS = 6  # u64, NBD_CFLAG_*
NBD_ATTR_SOCKETS = 7  # nested: NBD_SOCK_ITEM -> NBD_SOCK_FD
NBD_ATTR_DEAD_CONN_TIMEOUT = 8  # u64, seconds
NBD_ATTR_DEVICE_LIST = 9  # nested: NBD_DEVICE_ITEM -> NBD_DEVICE_INDEX, NBD_DEVICE_CONNECTED
NBD_ATTR_BACKEND_IDENTIFIER = 10  # string
NBD_DEVICE_ITEM_UNSPEC = 0
NBD_DEVICE_ITEM = 1
NBD_DEVICE_UNSPEC = 0
NBD_DEVICE_INDEX = 1  # u32
NBD_DEVICE_CONNECTED = 2  # u8
NBD_SOCK_ITEM_UNSPEC = 0
NBD_SOCK_ITEM = 1
NBD_SOCK_UNSPEC = 0
NBD_SOCK_FD = 1  # u32
NBD_CMD_UNSPEC = 0
NBD_CMD_CONNECT = 1
NBD_CMD_DISCONNECT = 2
NBD_CMD_RECONFIGURE = 3
NBD_CMD_LINK_DEAD = 4
NBD_CMD_STATUS = 5

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
GENLMSGHDR = struct.Struct("=BBH")  # cmd, version, reserved
NLATTR = struct.Struct("=HH")  # len, type
_U8, _U16, _U32, _U64 = (struct.Struct(f"={c}") for c in "BHIQ")
_I32 = struct.Struct("=i")

# ------------------------------------ errors (nbd.netlink_socket raises them too)


class NetlinkError(KernelNBDError):
    """An NLMSG_ERROR reply: ``errno`` plus the kernel's extended ack text, if any."""

    def __init__(self, errno_: int, message: str = "") -> None:
        text = os.strerror(errno_) + (f": {message}" if message else "")
        super().__init__(text)
        self.errno = errno_
        self.message = message


class NetlinkParseError(KernelNBDError):
    """A netlink message or attribute stream is malformed."""


class FamilyNotFound(KernelNBDError):
    """No generic netlink family of that name is registered."""


# -------------------------------------------------- netlink codec (pure)


def _align(n: int) -> int:
    return (n + NLA_ALIGNTO - 1) & ~(NLA_ALIGNTO - 1)


def nla(type_: int, payload: bytes) -> bytes:
    """One attribute: header, payload, zero padding to 4 bytes (not counted in nla_len)."""
    length = NLATTR.size + len(payload)
    if length > 0xFFFF:
        raise ValueError(f"netlink attribute of {length} bytes is too large")
    return NLATTR.pack(length, type_) + payload + bytes(_align(length) - length)


def nla_u8(type_: int, value: int) -> bytes:
    return nla(type_, _U8.pack(value))


def nla_u16(type_: int, value: int) -> bytes:
    return nla(type_, _U16.pack(value))


def nla_u32(type_: int, value: int) -> bytes:
    return nla(type_, _U32.pack(value))


def nla_u64(type_: int, value: int) -> bytes:
    return nla(type_, _U64.pack(value))


def nla_string(type_: int, value: str) -> bytes:
    """NLA_STRING / NLA_NUL_STRING: the kernel's policies accept the trailing NUL."""
    return nla(type_, value.encode() + b"\0")


def nla_nested(type_: int, *attrs: bytes) -> bytes:
    """A nested attribute, flagged NLA_F_NESTED.

    nbd's netlink ops parse with GENL_DONT_VALIDATE_STRICT and
    nla_parse_nested_deprecated, and nla_type() masks the flag off, so the
    kernel accepts nests with or without it; setting it is what strict
    validation would demand and what current libnl sends.
    """
    return nla(type_ | NLA_F_NESTED, b"".join(attrs))


def nlmsg(type_: int, flags: int, seq: int, payload: bytes, pid: int = 0) -> bytes:
    return NLMSGHDR.pack(NLMSGHDR.size + len(payload), type_, flags, seq, pid) + payload


def genlmsg(
    family: int, cmd: int, version: int, attrs: Sequence[bytes], seq: int, flags: int
) -> bytes:
    body = GENLMSGHDR.pack(cmd, version, 0) + b"".join(attrs)
    return nlmsg(family, flags, seq, body)


@dataclass(frozen=True, slots=True)
class NetlinkMessage:
    type: int
    flags: int
    seq: int
    pid: int
    payload: bytes


def parse_nlmsgs(data: bytes) -> list[NetlinkMessage]:
    """Split a datagram into its netlink messages."""
    out: list[NetlinkMessage] = []
    pos = 0
    while len(data) - pos >= NLMSGHDR.size:
        length, type_, flags, seq, pid = NLMSGHDR.unpack_from(data, pos)
        if length < NLMSGHDR.size or length > len(data) - pos:
            raise NetlinkParseError(f"netlink message length {length} at offset {pos} is invalid")
        out.append(NetlinkMessage(type_, flags, seq, pid, data[pos + NLMSGHDR.size : pos + length]))
        pos += _align(length)
    return out


def parse_attrs(data: bytes) -> list[tuple[int, bytes]]:
    """Attributes as (type without NLA_F_* flags, payload), in order."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while len(data) - pos >= NLATTR.size:
        length, type_ = NLATTR.unpack_from(data, pos)
        if length < NLATTR.size or length > len(data) - pos:
            raise NetlinkParseError(f"attribute length {length} at offset {pos} is invalid")
        out.append((type_ & NLA_TYPE_MASK, data[pos + NLATTR.size : pos + length]))
        pos += _align(length)
    return out


def attr_map(data: bytes) -> dict[int, bytes]:
    """Attributes by type; a repeated type keeps its last value, as nla_parse does."""
    return dict(parse_attrs(data))


def _get_uint(attrs: dict[int, bytes], type_: int, what: str) -> int:
    raw = attrs.get(type_)
    if raw is None:
        raise NetlinkParseError(f"{what} missing")
    for s in (_U8, _U16, _U32, _U64):
        if len(raw) == s.size:
            return int(s.unpack(raw)[0])
    raise NetlinkParseError(f"{what} has {len(raw)} bytes")


def _get_str(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def parse_genl(msg: NetlinkMessage) -> tuple[int, int, dict[int, bytes]]:
    """Return (cmd, version, attributes) of a generic netlink message."""
    if len(msg.payload) < GENLMSGHDR.size:
        raise NetlinkParseError("generic netlink message shorter than its header")
    cmd, version, _ = GENLMSGHDR.unpack_from(msg.payload)
    return cmd, version, attr_map(msg.payload[GENLMSGHDR.size :])


def parse_nlmsgerr(msg: NetlinkMessage) -> tuple[int, str]:
    """Return (positive errno or 0 for an ack, extended ack message) of an NLMSG_ERROR."""
    if len(msg.payload) < _I32.size + NLMSGHDR.size:
        raise NetlinkParseError("NLMSG_ERROR shorter than struct nlmsgerr")
    (error,) = _I32.unpack_from(msg.payload)
    text = ""
    if msg.flags & NLM_F_ACK_TLVS:
        if msg.flags & NLM_F_CAPPED:
            offset = _I32.size + NLMSGHDR.size
        else:
            (echoed_len,) = struct.unpack_from("=I", msg.payload, _I32.size)
            offset = _I32.size + _align(echoed_len)
        tlvs = attr_map(msg.payload[offset:])
        if NLMSGERR_ATTR_MSG in tlvs:
            text = _get_str(tlvs[NLMSGERR_ATTR_MSG])
    return -error, text


# --------------------------------------------------- requests and replies


def getfamily_request(name: str, seq: int) -> bytes:
    """CTRL_CMD_GETFAMILY for ``name`` (asking for it may make the kernel load its module)."""
    return genlmsg(
        GENL_ID_CTRL,
        CTRL_CMD_GETFAMILY,
        CTRL_VERSION,
        [nla_string(CTRL_ATTR_FAMILY_NAME, name)],
        seq,
        NLM_F_REQUEST | NLM_F_ACK,
    )


@dataclass(frozen=True, slots=True)
class GenlFamily:
    id: int
    name: str
    version: int
    mcast_groups: dict[str, int]


def parse_family(messages: Sequence[NetlinkMessage]) -> GenlFamily:
    """The family from a CTRL_CMD_GETFAMILY reply (a CTRL_CMD_NEWFAMILY message)."""
    for msg in messages:
        if msg.type != GENL_ID_CTRL:
            continue
        cmd, _, attrs = parse_genl(msg)
        if cmd != CTRL_CMD_NEWFAMILY:
            continue
        groups: dict[str, int] = {}
        for _, group in parse_attrs(attrs.get(CTRL_ATTR_MCAST_GROUPS, b"")):
            g = attr_map(group)
            if CTRL_ATTR_MCAST_GRP_NAME in g:
                name = _get_str(g[CTRL_ATTR_MCAST_GRP_NAME])
                groups[name] = _get_uint(g, CTRL_ATTR_MCAST_GRP_ID, "multicast group id")
        return GenlFamily(
            id=_get_uint(attrs, CTRL_ATTR_FAMILY_ID, "CTRL_ATTR_FAMILY_ID"),
            name=_get_str(attrs.get(CTRL_ATTR_FAMILY_NAME, b"")),
            version=_get_uint(attrs, CTRL_ATTR_VERSION, "CTRL_ATTR_VERSION")
            if CTRL_ATTR_VERSION in attrs
            else 0,
            mcast_groups=groups,
        )
    raise NetlinkParseError("no CTRL_CMD_NEWFAMILY message in the reply")


def _sockets_attr(sock_fds: Sequence[int]) -> bytes:
    return nla_nested(
        NBD_ATTR_SOCKETS, *(nla_nested(NBD_SOCK_ITEM, nla_u32(NBD_SOCK_FD, fd)) for fd in sock_fds)
    )


def nbd_connect_request(
    family: int,
    seq: int,
    *,
    size: int,
    block_size: int,
    server_flags: int,
    sock_fds: Sequence[int],
    index: int | None = None,
    timeout: int | None = None,
    dead_conn_timeout: int | None = None,
    client_flags: int | None = None,
    backend_identifier: str | None = None,
) -> bytes:
    """NBD_CMD_CONNECT; without ``index`` the kernel picks (or adds) a free device."""
    if not sock_fds:
        raise ValueError("NBD_CMD_CONNECT needs at least one socket")
    attrs: list[bytes] = []
    if index is not None:
        attrs.append(nla_u32(NBD_ATTR_INDEX, index))
    attrs += [
        nla_u64(NBD_ATTR_SIZE_BYTES, size),
        nla_u64(NBD_ATTR_BLOCK_SIZE_BYTES, block_size),
        nla_u64(NBD_ATTR_SERVER_FLAGS, server_flags),
    ]
    if client_flags is not None:
        attrs.append(nla_u64(NBD_ATTR_CLIENT_FLAGS, client_flags))
    if timeout is not None:
        attrs.append(nla_u64(NBD_ATTR_TIMEOUT, timeout))
    if dead_conn_timeout is not None:
        attrs.append(nla_u64(NBD_ATTR_DEAD_CONN_TIMEOUT, dead_conn_timeout))
    if backend_identifier is not None:
        attrs.append(nla_string(NBD_ATTR_BACKEND_IDENTIFIER, backend_identifier))
    attrs.append(_sockets_attr(sock_fds))
    return genlmsg(family, NBD_CMD_CONNECT, NBD_GENL_VERSION, attrs, seq, NLM_F_REQUEST | NLM_F_ACK)


def nbd_disconnect_request(family: int, seq: int, index: int) -> bytes:
    attrs = [nla_u32(NBD_ATTR_INDEX, index)]
    return genlmsg(
        family, NBD_CMD_DISCONNECT, NBD_GENL_VERSION, attrs, seq, NLM_F_REQUEST | NLM_F_ACK
    )


def nbd_reconfigure_request(
    family: int,
    seq: int,
    index: int,
    *,
    sock_fds: Sequence[int] = (),
    size: int | None = None,
    backend_identifier: str | None = None,
) -> bytes:
    """NBD_CMD_RECONFIGURE: a fresh socket replaces a dead one; a size resizes.

    A device connected with a backend identifier only accepts a reconfigure
    naming the same identifier.
    """
    attrs = [nla_u32(NBD_ATTR_INDEX, index)]
    if size is not None:
        attrs.append(nla_u64(NBD_ATTR_SIZE_BYTES, size))
    if backend_identifier is not None:
        attrs.append(nla_string(NBD_ATTR_BACKEND_IDENTIFIER, backend_identifier))
    if sock_fds:
        attrs.append(_sockets_attr(sock_fds))
    return genlmsg(
        family, NBD_CMD_RECONFIGURE, NBD_GENL_VERSION, attrs, seq, NLM_F_REQUEST | NLM_F_ACK
    )


def nbd_status_request(family: int, seq: int, index: int | None = None) -> bytes:
    attrs = [] if index is None else [nla_u32(NBD_ATTR_INDEX, index)]
    return genlmsg(family, NBD_CMD_STATUS, NBD_GENL_VERSION, attrs, seq, NLM_F_REQUEST | NLM_F_ACK)


def _nbd_replies(
    messages: Sequence[NetlinkMessage], family: int, cmd: int
) -> Iterator[dict[int, bytes]]:
    for msg in messages:
        if msg.type == family:
            got, _, attrs = parse_genl(msg)
            if got == cmd:
                yield attrs


def parse_connect_reply(messages: Sequence[NetlinkMessage], family: int) -> int:
    """The device index the kernel connected (the reply carries NBD_ATTR_INDEX)."""
    for attrs in _nbd_replies(messages, family, NBD_CMD_CONNECT):
        return _get_uint(attrs, NBD_ATTR_INDEX, "NBD_ATTR_INDEX")
    raise NetlinkParseError("no NBD_CMD_CONNECT reply with the device index")


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    index: int
    connected: bool

    @property
    def device(self) -> str:
        return f"/dev/nbd{self.index}"


def parse_status_reply(messages: Sequence[NetlinkMessage], family: int) -> list[DeviceStatus]:
    """Devices from an NBD_CMD_STATUS reply: DEVICE_LIST -> DEVICE_ITEM -> INDEX, CONNECTED."""
    devices: list[DeviceStatus] = []
    for attrs in _nbd_replies(messages, family, NBD_CMD_STATUS):
        for item_type, item in parse_attrs(attrs.get(NBD_ATTR_DEVICE_LIST, b"")):
            if item_type != NBD_DEVICE_ITEM:
                continue
            fields = attr_map(item)
            devices.append(
                DeviceStatus(
                    index=_get_uint(fields, NBD_DEVICE_INDEX, "NBD_DEVICE_INDEX"),
                    connected=bool(_get_uint(fields, NBD_DEVICE_CONNECTED, "NBD_DEVICE_CONNECTED")),
                )
            )
    return devices


def parse_link_dead(messages: Sequence[NetlinkMessage], family: int) -> list[int]:
    """Device indices from NBD_CMD_LINK_DEAD multicast notifications."""
    return [
        _get_uint(attrs, NBD_ATTR_INDEX, "NBD_ATTR_INDEX")
        for attrs in _nbd_replies(messages, family, NBD_CMD_LINK_DEAD)
    ]

"""Handing a negotiated NBD socket to the kernel's nbd driver (``/dev/nbdN``).

Two interfaces, chosen at run time by probing:

- generic netlink, family ``"nbd"`` (``linux/nbd-netlink.h``, kernel 4.12+):
  CONNECT, DISCONNECT, RECONFIGURE, STATUS, and ``LINK_DEAD`` multicast
  notifications.  The kernel keeps its own reference to the socket, so no
  process has to stay alive for the device to work.
- the ioctl interface (``linux/nbd.h``) as a fallback: the setup ioctls, then
  ``NBD_DO_IT``, which blocks for the life of the device and so runs in a
  child process (in its own session); the device lives as long as that child.

Message building and parsing are pure functions over bytes; the socket and
ioctl I/O is kept apart, so every encoding is testable without the module.
Netlink is host byte order (``=`` in the struct formats).

The kernel driver speaks neither TLS nor structured replies: sockets from a
TLS handshake are refused (see ``nbd.client``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from nbd.client import Negotiated

# ----------------------------------------------- uapi values (kernel headers)
# Hard-coded so nothing needs the headers at run time; tests/unit/test_nbd_kernel.py
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

# linux/nbd.h
NBD_CFLAG_DESTROY_ON_DISCONNECT = 1 << 0
NBD_CFLAG_DISCONNECT_ON_CLOSE = 1 << 1


def _IO(type_: int, nr: int) -> int:
    """``_IO`` from asm-generic/ioctl.h: direction none, size 0."""
    return (0 << 30) | (0 << 16) | (type_ << 8) | nr


NBD_SET_SOCK = _IO(0xAB, 0)
NBD_SET_BLKSIZE = _IO(0xAB, 1)
NBD_SET_SIZE = _IO(0xAB, 2)
NBD_DO_IT = _IO(0xAB, 3)
NBD_CLEAR_SOCK = _IO(0xAB, 4)
NBD_CLEAR_QUE = _IO(0xAB, 5)
NBD_PRINT_DEBUG = _IO(0xAB, 6)
NBD_SET_SIZE_BLOCKS = _IO(0xAB, 7)
NBD_DISCONNECT = _IO(0xAB, 8)
NBD_SET_TIMEOUT = _IO(0xAB, 9)
NBD_SET_FLAGS = _IO(0xAB, 10)

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
GENLMSGHDR = struct.Struct("=BBH")  # cmd, version, reserved
NLATTR = struct.Struct("=HH")  # len, type
_U8, _U16, _U32, _U64 = (struct.Struct(f"={c}") for c in "BHIQ")
_I32 = struct.Struct("=i")

# Where the kernel shows its nbd state; module-level so tests can point elsewhere.
SYS_MODULE_NBD = Path("/sys/module/nbd")
SYS_BLOCK = Path("/sys/block")
DEV_DIR = Path("/dev")


class KernelNBDError(Exception):
    """The kernel refused or failed an nbd operation."""


class KernelNBDUnavailable(KernelNBDError):
    """This host's kernel has no usable nbd driver."""


class NetlinkError(KernelNBDError):
    """An NLMSG_ERROR reply: ``errno`` plus the kernel's extended ack text, if any."""

    def __init__(self, errno_: int, message: str = "") -> None:
        text = os.strerror(errno_) + (f": {message}" if message else "")
        super().__init__(text)
        self.errno = errno_
        self.message = message


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


class NetlinkParseError(KernelNBDError):
    """A netlink message or attribute stream is malformed."""


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


# --------------------------------------------------------------- netlink I/O

_RECV_BUFFER = 64 * 1024


class GenericNetlink:
    """A NETLINK_GENERIC socket for request/ack exchanges with the kernel."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        try:
            self.sock.bind((0, 0))
            self.sock.settimeout(timeout)
            # Error text from the kernel, and no echo of our request in acks.
            for option in (NETLINK_EXT_ACK, NETLINK_CAP_ACK):
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(SOL_NETLINK, option, 1)
        except BaseException:
            self.sock.close()
            raise
        self._seq = int(time.time()) & 0x7FFFFFFF

    def __enter__(self) -> GenericNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def recv_messages(self) -> list[NetlinkMessage]:
        data, _, flags, _ = self.sock.recvmsg(_RECV_BUFFER)
        if flags & socket.MSG_TRUNC:
            raise NetlinkParseError(f"netlink datagram larger than {_RECV_BUFFER} bytes")
        return parse_nlmsgs(data)

    def transact(self, build: Callable[[int], bytes]) -> list[NetlinkMessage]:
        """Send ``build(seq)`` (which asks for an ack); return the replies before the ack."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        self.sock.send(build(seq))
        replies: list[NetlinkMessage] = []
        while True:
            for msg in self.recv_messages():
                if msg.seq != seq:
                    continue
                if msg.type == NLMSG_ERROR:
                    error, text = parse_nlmsgerr(msg)
                    if error:
                        raise NetlinkError(error, text)
                    return replies
                if msg.type == NLMSG_DONE:
                    return replies
                replies.append(msg)


class FamilyNotFound(KernelNBDError):
    """No generic netlink family of that name is registered."""


def resolve_family(name: str, nl: GenericNetlink | None = None) -> GenlFamily:
    """Ask the controller for a family's id and multicast groups."""
    own = nl is None
    link = GenericNetlink() if nl is None else nl
    try:
        try:
            replies = link.transact(lambda seq: getfamily_request(name, seq))
        except NetlinkError as e:
            if e.errno == errno.ENOENT:
                raise FamilyNotFound(f"generic netlink family {name!r} is not registered") from e
            raise
        return parse_family(replies)
    finally:
        if own:
            link.close()


# ------------------------------------------------------------------ probing


@dataclass(frozen=True, slots=True)
class KernelSupport:
    """What the probe found: which interfaces work, and why (not)."""

    netlink: bool
    ioctl: bool
    reason: str
    family: GenlFamily | None = None

    @property
    def available(self) -> bool:
        return self.netlink or self.ioctl


def _nbd_devices() -> list[Path]:
    found = [p for p in DEV_DIR.glob("nbd*") if re.fullmatch(r"nbd\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[3:]))


def _lookup_nbd_family() -> tuple[GenlFamily | None, str]:
    try:
        return resolve_family(NBD_GENL_FAMILY_NAME), ""
    except FamilyNotFound as e:
        return None, str(e)
    except (OSError, KernelNBDError) as e:
        return None, f"generic netlink unusable: {e}"


def _modprobe() -> str | None:
    """Load the nbd module; None on success, else why it failed."""
    exe = shutil.which("modprobe") or next(
        (p for p in ("/usr/sbin/modprobe", "/sbin/modprobe") if os.access(p, os.X_OK)), None
    )
    if exe is None:
        return "modprobe is not installed"
    try:
        result = subprocess.run([exe, "nbd"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if result.returncode != 0:
        return result.stderr.strip() or f"modprobe exited {result.returncode}"
    return None


def probe_kernel_nbd(*, load_module: bool = True) -> KernelSupport:
    """Find out whether (and how) the kernel can take an NBD socket.

    Asking the controller for the "nbd" family is itself enough for a kernel
    with module autoloading to load nbd; ``modprobe nbd`` is tried after that
    when ``load_module`` is set and no trace of the module exists.
    """
    family, why_not = _lookup_nbd_family()
    if family is None and not (SYS_MODULE_NBD.exists() or (DEV_DIR / "nbd0").exists()):
        if not load_module:
            return KernelSupport(False, False, "kernel nbd unavailable: no nbd module loaded")
        failure = _modprobe()
        if failure is not None:
            return KernelSupport(
                False,
                False,
                f"kernel nbd unavailable: no nbd module loaded and modprobe nbd failed: {failure}",
            )
        family, why_not = _lookup_nbd_family()
    devices = _nbd_devices()
    if family is not None:
        return KernelSupport(
            True,
            bool(devices),
            f"kernel nbd available: generic netlink family {family.name!r} (id {family.id})",
            family,
        )
    if devices:
        return KernelSupport(
            False,
            True,
            f"kernel nbd available through ioctl on {devices[0]} ({why_not})",
        )
    return KernelSupport(
        False,
        False,
        f"kernel nbd unavailable: the nbd module is present but there is no /dev/nbd* "
        f"device and {why_not}",
    )


def kernel_nbd_available(*, load_module: bool = True) -> tuple[bool, str]:
    """(usable, reason): the reason says which interface, or why there is none."""
    support = probe_kernel_nbd(load_module=load_module)
    return support.available, support.reason


# ----------------------------------------------------------------- attaching


def device_index(device: str) -> int:
    """3 for "/dev/nbd3" or "nbd3"."""
    m = re.fullmatch(r"(?:/dev/)?nbd(\d+)", device)
    if m is None:
        raise ValueError(f"not an nbd device: {device!r}")
    return int(m.group(1))


def kernel_block_size(negotiated: Negotiated, requested: int | None = None) -> int:
    """The device's logical block size: 512 unless asked for more or the server's minimum is.

    The kernel takes powers of two from 512 to the page size.
    """
    minimum = negotiated.block_size.minimum if negotiated.block_size else 1
    size = requested if requested is not None else max(512, minimum)
    page = os.sysconf("SC_PAGE_SIZE")
    if size & (size - 1) or not 512 <= size <= page:
        raise ValueError(f"kernel nbd block size must be a power of two in 512..{page}, not {size}")
    if size < minimum:
        raise ValueError(f"block size {size} is below the server's minimum block size {minimum}")
    return size


# The driver's largest request (max_hw_sectors = 65536 sectors), whatever the server says.
KERNEL_MAX_REQUEST = 65536 * 512


def _check_server_limits(negotiated: Negotiated) -> None:
    """The kernel cannot be told a maximum payload: the server must take the driver's."""
    limits = negotiated.block_size
    if limits is not None and limits.maximum < KERNEL_MAX_REQUEST:
        raise KernelNBDError(
            f"the server's maximum payload of {limits.maximum} bytes is below the "
            f"{KERNEL_MAX_REQUEST} bytes the kernel nbd driver may send in one request"
        )


def _refuse_tls(negotiated: Negotiated) -> None:
    if negotiated.tls or isinstance(negotiated.sock, ssl.SSLSocket):
        raise KernelNBDError(
            "the kernel nbd driver cannot speak TLS: a socket from a TLS handshake can only "
            "be used from userspace (no TLS proxy is available)"
        )


def _netlink_family() -> GenlFamily:
    family, why_not = _lookup_nbd_family()
    if family is None:
        raise KernelNBDUnavailable(f"kernel nbd netlink interface unavailable: {why_not}")
    return family


def attach_kernel(
    negotiated: Negotiated,
    *,
    index: int | None = None,
    block_size: int | None = None,
    io_timeout: int | None = None,
    dead_conn_timeout: int | None = None,
    client_flags: int | None = None,
    backend_identifier: str | None = None,
    load_module: bool = True,
) -> str:
    """Give the negotiated socket to the kernel; return the device path ("/dev/nbdN").

    Timeouts are in seconds; None leaves the kernel's default.  After success
    the kernel holds its own reference to the socket, and the caller may
    close ``negotiated.sock``.  Raises ``KernelNBDUnavailable`` (touching
    nothing) when the host has no nbd driver.
    """
    _refuse_tls(negotiated)
    _check_server_limits(negotiated)
    bs = kernel_block_size(negotiated, block_size)
    support = probe_kernel_nbd(load_module=load_module)
    if support.family is not None:
        family = support.family
        request = lambda seq: nbd_connect_request(  # noqa: E731
            family.id,
            seq,
            size=negotiated.size,
            block_size=bs,
            server_flags=int(negotiated.transmission_flags),
            sock_fds=[negotiated.sock.fileno()],
            index=index,
            timeout=io_timeout,
            dead_conn_timeout=dead_conn_timeout,
            client_flags=client_flags,
            backend_identifier=backend_identifier,
        )
        try:
            with GenericNetlink() as nl:
                replies = nl.transact(request)
        except NetlinkError as e:
            raise KernelNBDError(f"NBD_CMD_CONNECT failed: {e}") from e
        return f"/dev/nbd{parse_connect_reply(replies, family.id)}"
    if support.ioctl:
        return _attach_ioctl(negotiated, index, bs, io_timeout)
    raise KernelNBDUnavailable(support.reason)


def detach_kernel(device: str) -> None:
    """Disconnect ``device`` (NBD_CMD_DISCONNECT, or NBD_DISCONNECT + NBD_CLEAR_SOCK)."""
    index = device_index(device)
    support = probe_kernel_nbd(load_module=False)
    if support.family is not None:
        family = support.family
        try:
            with GenericNetlink() as nl:
                nl.transact(lambda seq: nbd_disconnect_request(family.id, seq, index))
        except NetlinkError as e:
            raise KernelNBDError(f"NBD_CMD_DISCONNECT of /dev/nbd{index} failed: {e}") from e
        return
    if support.ioctl:
        _detach_ioctl(index)
        return
    raise KernelNBDUnavailable(support.reason)


def reconnect_kernel(
    device: str, negotiated: Negotiated, *, backend_identifier: str | None = None
) -> None:
    """Replace a dead connection of ``device`` with a freshly negotiated socket."""
    _refuse_tls(negotiated)
    index = device_index(device)
    family = _netlink_family()
    try:
        with GenericNetlink() as nl:
            nl.transact(
                lambda seq: nbd_reconfigure_request(
                    family.id,
                    seq,
                    index,
                    sock_fds=[negotiated.sock.fileno()],
                    backend_identifier=backend_identifier,
                )
            )
    except NetlinkError as e:
        raise KernelNBDError(f"NBD_CMD_RECONFIGURE of /dev/nbd{index} failed: {e}") from e


def resize_kernel(device: str, size: int, *, backend_identifier: str | None = None) -> None:
    """Tell the kernel the export grew (or shrank) to ``size`` bytes."""
    index = device_index(device)
    family = _netlink_family()
    try:
        with GenericNetlink() as nl:
            nl.transact(
                lambda seq: nbd_reconfigure_request(
                    family.id, seq, index, size=size, backend_identifier=backend_identifier
                )
            )
    except NetlinkError as e:
        raise KernelNBDError(f"resizing /dev/nbd{index} failed: {e}") from e


def kernel_status(index: int | None = None) -> list[DeviceStatus]:
    """The kernel's nbd devices (or just ``index``) and whether each is connected."""
    family = _netlink_family()
    try:
        with GenericNetlink() as nl:
            replies = nl.transact(lambda seq: nbd_status_request(family.id, seq, index))
    except NetlinkError as e:
        raise KernelNBDError(f"NBD_CMD_STATUS failed: {e}") from e
    return parse_status_reply(replies, family.id)


class LinkDeadMonitor:
    """Listens on "nbd_mc_group" for NBD_CMD_LINK_DEAD: a device lost its connection.

    The answer to one is ``reconnect_kernel`` with a fresh socket, within the
    device's dead-connection timeout.
    """

    def __init__(self) -> None:
        self.family = _netlink_family()
        group = self.family.mcast_groups.get(NBD_GENL_MCAST_GROUP_NAME)
        if group is None:
            raise KernelNBDUnavailable(f"no {NBD_GENL_MCAST_GROUP_NAME!r} multicast group")
        self._nl = GenericNetlink(timeout=0)
        try:
            self._nl.sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
        except BaseException:
            self._nl.close()
            raise

    def fileno(self) -> int:
        return self._nl.sock.fileno()

    def wait(self, timeout: float | None = None) -> list[int]:
        """Indices of devices whose link died; [] if nothing arrived within ``timeout``."""
        self._nl.sock.settimeout(timeout)
        try:
            messages = self._nl.recv_messages()
        except TimeoutError:
            return []
        return parse_link_dead(messages, self.family.id)

    def close(self) -> None:
        self._nl.close()

    def __enter__(self) -> LinkDeadMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------- ioctl fallback


def ioctl_setup_plan(
    *,
    size: int,
    block_size: int,
    server_flags: int,
    sock_fd: int,
    io_timeout: int | None = None,
    ulong_bytes: int = struct.calcsize("L"),
) -> list[tuple[str, int, int]]:
    """The (name, request, argument) ioctls that configure a device before NBD_DO_IT.

    The socket goes last: until then, closing the device undoes everything.
    """
    plan = [("NBD_SET_BLKSIZE", NBD_SET_BLKSIZE, block_size)]
    if size < 1 << (8 * ulong_bytes):
        plan.append(("NBD_SET_SIZE", NBD_SET_SIZE, size))
    else:  # a 32-bit unsigned long cannot carry the size in bytes
        plan.append(("NBD_SET_SIZE_BLOCKS", NBD_SET_SIZE_BLOCKS, size // block_size))
    plan.append(("NBD_SET_FLAGS", NBD_SET_FLAGS, server_flags))
    if io_timeout is not None:
        plan.append(("NBD_SET_TIMEOUT", NBD_SET_TIMEOUT, io_timeout))
    plan.append(("NBD_SET_SOCK", NBD_SET_SOCK, sock_fd))
    return plan


def _ioctl(fd: int, request: int, arg: int) -> None:
    # ctypes rather than fcntl.ioctl: that passes a C int, too small for NBD_SET_SIZE.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong]
    libc.ioctl.restype = ctypes.c_int
    if libc.ioctl(fd, request, arg) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# NBD_DO_IT blocks until the device is disconnected, so a child owns it; it
# inherits the device descriptor, which keeps the configuration alive.
_DO_IT_CHILD = """
import fcntl, sys
fd, do_it, clear_que, clear_sock = (int(a) for a in sys.argv[1:5])
try:
    fcntl.ioctl(fd, do_it)
    code = 0
except OSError as e:
    print(f"NBD_DO_IT on {sys.argv[5]}: {e}", file=sys.stderr)
    code = 1
for request in (clear_que, clear_sock):
    try:
        fcntl.ioctl(fd, request)
    except OSError:
        pass
sys.exit(code)
"""
_DO_IT_REQUESTS = (NBD_DO_IT, NBD_CLEAR_QUE, NBD_CLEAR_SOCK)
_do_it_children: dict[int, subprocess.Popen[bytes]] = {}


def _apply_plan(fd: int, plan: Sequence[tuple[str, int, int]]) -> tuple[str, OSError] | None:
    """Run the setup ioctls; the first failure as (ioctl name, error), else None."""
    for name, request, arg in plan:
        try:
            _ioctl(fd, request, arg)
        except OSError as e:
            return name, e
    return None


def _free_ioctl_indices() -> list[int]:
    free = []
    for dev in _nbd_devices():
        i = int(dev.name[3:])
        sys_dir = SYS_BLOCK / dev.name
        try:
            unused = not (sys_dir / "pid").exists() and int((sys_dir / "size").read_text()) == 0
        except (OSError, ValueError):
            continue
        if unused:
            free.append(i)
    return free


def _wait_started(index: int, device: Path, child: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the kernel shows the device running (its pid file), or the child fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            _, stderr = child.communicate()
            raise KernelNBDError(f"NBD_DO_IT failed on {device}: {stderr.decode().strip()}")
        if (SYS_BLOCK / f"nbd{index}" / "pid").exists():
            return
        time.sleep(0.05)
    child.kill()
    child.communicate()
    raise KernelNBDError(f"{device} did not start within {timeout}s")


def _attach_ioctl(
    negotiated: Negotiated, index: int | None, block_size: int, io_timeout: int | None
) -> str:
    candidates = [index] if index is not None else _free_ioctl_indices()
    if not candidates:
        raise KernelNBDError("no free /dev/nbd* device")
    plan = ioctl_setup_plan(
        size=negotiated.size,
        block_size=block_size,
        server_flags=int(negotiated.transmission_flags),
        sock_fd=negotiated.sock.fileno(),
        io_timeout=io_timeout,
    )
    busy: list[str] = []
    for i in candidates:
        device = DEV_DIR / f"nbd{i}"
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
        try:
            failed = _apply_plan(fd, plan)
            if failed is not None:
                name, e = failed
                if e.errno == errno.EBUSY and index is None:
                    busy.append(device.name)  # another attacher won the race; next one
                    continue
                raise KernelNBDError(f"{name} on {device} failed: {e}") from e
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _DO_IT_CHILD,
                    str(fd),
                    *map(str, _DO_IT_REQUESTS),
                    str(device),
                ],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            _wait_started(i, device, child, timeout=10.0)
        finally:
            os.close(fd)
        _do_it_children[i] = child
        return str(device)
    raise KernelNBDError(f"every free nbd device was busy: {', '.join(busy)}")


def _detach_ioctl(index: int) -> None:
    device = DEV_DIR / f"nbd{index}"
    fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    try:
        for name, request in (
            ("NBD_DISCONNECT", NBD_DISCONNECT),
            ("NBD_CLEAR_SOCK", NBD_CLEAR_SOCK),
        ):
            try:
                _ioctl(fd, request, 0)
            except OSError as e:
                raise KernelNBDError(f"{name} on {device} failed: {e}") from e
    finally:
        os.close(fd)
    child = _do_it_children.pop(index, None)
    if child is not None:
        try:
            child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()


__all__ = [
    "DeviceStatus",
    "GenericNetlink",
    "GenlFamily",
    "KernelNBDError",
    "KernelNBDUnavailable",
    "KernelSupport",
    "LinkDeadMonitor",
    "NetlinkError",
    "attach_kernel",
    "detach_kernel",
    "device_index",
    "kernel_block_size",
    "kernel_nbd_available",
    "kernel_status",
    "probe_kernel_nbd",
    "reconnect_kernel",
    "resize_kernel",
    "resolve_family",
]

"""Kernel attach (``nbd.kernel``): netlink and ioctl encodings, byte for byte.

The expected bytes are assembled by hand here, field by field, without the
module's struct formats.  Netlink is host byte order, so the fields are
written with ``int.to_bytes(..., sys.byteorder)``.  Every uapi value the
module hard-codes is also checked against the installed kernel headers
(``linux-libc-dev``, installed by deploy/host/install-deps.sh).

This CI kernel has no nbd driver: the probe and ``attach_kernel`` are proven
to fail cleanly here.  On a host that has one, the ``no_kernel_nbd`` fixture
hides it, so the same tests still prove the unavailable path.
"""

from __future__ import annotations

import ast
import errno
import os
import re
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nbd import constants, kernel
from nbd.client import BlockSize, Negotiated
from nbd.constants import TransmissionFlag
from nbd.kernel import (
    DeviceStatus,
    GenlFamily,
    KernelNBDError,
    KernelNBDUnavailable,
    NetlinkParseError,
)

INCLUDE = Path("/usr/include")
NBD_NETLINK_H = INCLUDE / "linux/nbd-netlink.h"
NBD_H = INCLUDE / "linux/nbd.h"
NETLINK_H = INCLUDE / "linux/netlink.h"
GENETLINK_H = INCLUDE / "linux/genetlink.h"
IOCTL_H = INCLUDE / "asm-generic/ioctl.h"

FAMILY = 0x1D  # an nbd family id as the controller might hand it out
PORT_ID = 0x2B3B  # the kernel-assigned netlink port id in canned replies


def u8(n: int) -> bytes:
    return n.to_bytes(1, sys.byteorder)


def u16(n: int) -> bytes:
    return n.to_bytes(2, sys.byteorder)


def u32(n: int) -> bytes:
    return n.to_bytes(4, sys.byteorder)


def u64(n: int) -> bytes:
    return n.to_bytes(8, sys.byteorder)


def i32(n: int) -> bytes:
    return n.to_bytes(4, sys.byteorder, signed=True)


def nlhdr(length: int, type_: int, flags: int, seq: int, pid: int = 0) -> bytes:
    return u32(length) + u16(type_) + u16(flags) + u32(seq) + u32(pid)


def genlhdr(cmd: int, version: int) -> bytes:
    return u8(cmd) + u8(version) + u16(0)


# ------------------------------------------------------ attribute encoding


def test_attribute_is_length_type_payload_padded_to_four_bytes() -> None:
    # nla_len counts header + payload, never the padding.
    assert kernel.nla_u8(2, 1) == u16(5) + u16(2) + b"\x01" + b"\0\0\0"
    assert kernel.nla_u16(1, 0x1D) == u16(6) + u16(1) + u16(0x1D) + b"\0\0"
    assert kernel.nla_u32(1, 7) == u16(8) + u16(1) + u32(7)
    assert kernel.nla_u64(2, 1 << 40) == u16(12) + u16(2) + u64(1 << 40)
    # Strings carry their NUL: "nbd\0" fills 4 bytes exactly, "nbd_mc_group\0" needs 3 pad.
    assert kernel.nla_string(2, "nbd") == u16(8) + u16(2) + b"nbd\0"
    assert kernel.nla_string(1, "nbd_mc_group") == u16(17) + u16(1) + b"nbd_mc_group\0" + b"\0" * 3
    assert kernel.nla(5, b"") == u16(4) + u16(5)


def test_nested_attribute_sets_nla_f_nested_and_counts_padded_children() -> None:
    inner = kernel.nla_u8(2, 1)  # 8 bytes with its padding
    nested = kernel.nla_nested(1, inner, kernel.nla_u32(1, 3))
    assert nested == u16(4 + 8 + 8) + u16(0x8001) + inner + u16(8) + u16(1) + u32(3)
    # Parsing masks the flag off, as the kernel's nla_type() does.
    assert kernel.parse_attrs(nested) == [(1, inner + u16(8) + u16(1) + u32(3))]
    assert kernel.parse_attrs(u16(8) + u16(0x4003) + u32(9)) == [(3, u32(9))]


def test_malformed_attributes_and_messages_are_rejected() -> None:
    with pytest.raises(NetlinkParseError):
        kernel.parse_attrs(u16(12) + u16(1) + u32(0))  # claims more than there is
    with pytest.raises(NetlinkParseError):
        kernel.parse_attrs(u16(2) + u16(1))  # shorter than its own header
    with pytest.raises(NetlinkParseError):
        kernel.parse_nlmsgs(nlhdr(64, 0x10, 0, 1))
    with pytest.raises(ValueError, match="too large"):
        kernel.nla(1, bytes(0x10000))


# --------------------------------------------------------------- requests


def test_getfamily_request_bytes() -> None:
    expected = (
        nlhdr(28, 0x10, 0x01 | 0x04, 9)  # GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK
        + genlhdr(3, 1)  # CTRL_CMD_GETFAMILY, version 1
        + u16(8) + u16(2) + b"nbd\0"  # CTRL_ATTR_FAMILY_NAME
    )  # fmt: skip
    assert len(expected) == 28
    assert kernel.getfamily_request("nbd", 9) == expected


def test_connect_message_for_a_negotiated_export() -> None:
    """NBD_CMD_CONNECT for a 1 GiB export, 512-byte blocks, one socket (fd 5), no index."""
    flags = 0x01 | 0x04 | 0x08 | 0x20 | 0x100  # HAS_FLAGS SEND_FLUSH SEND_FUA SEND_TRIM MULTI_CONN
    message = kernel.nbd_connect_request(
        FAMILY,
        7,
        size=1 << 30,
        block_size=512,
        server_flags=flags,
        sock_fds=[5],
        timeout=30,
        dead_conn_timeout=60,
    )
    expected = (
        nlhdr(96, FAMILY, 0x05, 7)
        + genlhdr(1, 1)  # NBD_CMD_CONNECT, NBD_GENL_VERSION
        + u16(12) + u16(2) + u64(1 << 30)  # NBD_ATTR_SIZE_BYTES
        + u16(12) + u16(3) + u64(512)  # NBD_ATTR_BLOCK_SIZE_BYTES
        + u16(12) + u16(5) + u64(0x12D)  # NBD_ATTR_SERVER_FLAGS
        + u16(12) + u16(4) + u64(30)  # NBD_ATTR_TIMEOUT
        + u16(12) + u16(8) + u64(60)  # NBD_ATTR_DEAD_CONN_TIMEOUT
        + u16(16) + u16(0x8000 | 7)  # NBD_ATTR_SOCKETS, nested
        + u16(12) + u16(0x8000 | 1)  # NBD_SOCK_ITEM, nested
        + u16(8) + u16(1) + u32(5)  # NBD_SOCK_FD
    )  # fmt: skip
    assert len(expected) == 96
    assert message == expected


def test_connect_message_with_index_client_flags_backend_and_two_sockets() -> None:
    message = kernel.nbd_connect_request(
        FAMILY,
        1,
        size=4096,
        block_size=4096,
        server_flags=0x3,
        sock_fds=[3, 4],
        index=2,
        client_flags=kernel.NBD_CFLAG_DESTROY_ON_DISCONNECT,
        backend_identifier="vol-1",
    )
    expected_attrs = (
        u16(8) + u16(1) + u32(2)  # NBD_ATTR_INDEX first
        + u16(12) + u16(2) + u64(4096)
        + u16(12) + u16(3) + u64(4096)
        + u16(12) + u16(5) + u64(3)
        + u16(12) + u16(6) + u64(1)  # NBD_ATTR_CLIENT_FLAGS
        + u16(10) + u16(10) + b"vol-1\0" + b"\0\0"  # NBD_ATTR_BACKEND_IDENTIFIER
        + u16(28) + u16(0x8007)
        + u16(12) + u16(0x8001) + u16(8) + u16(1) + u32(3)
        + u16(12) + u16(0x8001) + u16(8) + u16(1) + u32(4)
    )  # fmt: skip
    assert message == nlhdr(20 + len(expected_attrs), FAMILY, 5, 1) + genlhdr(1, 1) + expected_attrs
    with pytest.raises(ValueError, match="at least one socket"):
        kernel.nbd_connect_request(FAMILY, 1, size=1, block_size=512, server_flags=0, sock_fds=[])


def test_disconnect_status_and_reconfigure_messages() -> None:
    assert kernel.nbd_disconnect_request(FAMILY, 3, 4) == (
        nlhdr(28, FAMILY, 5, 3) + genlhdr(2, 1) + u16(8) + u16(1) + u32(4)
    )
    assert kernel.nbd_status_request(FAMILY, 4) == nlhdr(20, FAMILY, 5, 4) + genlhdr(5, 1)
    assert kernel.nbd_status_request(FAMILY, 5, index=0) == (
        nlhdr(28, FAMILY, 5, 5) + genlhdr(5, 1) + u16(8) + u16(1) + u32(0)
    )
    # A fresh socket for a dead connection.
    assert kernel.nbd_reconfigure_request(FAMILY, 6, 1, sock_fds=[9]) == (
        nlhdr(44, FAMILY, 5, 6)
        + genlhdr(3, 1)
        + u16(8) + u16(1) + u32(1)
        + u16(16) + u16(0x8007) + u16(12) + u16(0x8001) + u16(8) + u16(1) + u32(9)
    )  # fmt: skip
    # A resize.
    assert kernel.nbd_reconfigure_request(FAMILY, 7, 1, size=8 << 30) == (
        nlhdr(40, FAMILY, 5, 7) + genlhdr(3, 1) + u16(8) + u16(1) + u32(1)
        + u16(12) + u16(2) + u64(8 << 30)
    )  # fmt: skip


# ---------------------------------------------------------------- replies


def ack(seq: int) -> bytes:
    """NLMSG_ERROR with error 0, capped (NETLINK_CAP_ACK): only the request header echoed."""
    echoed = nlhdr(20, FAMILY, 5, seq)
    return nlhdr(36, 0x2, 0x100, seq, PORT_ID) + i32(0) + echoed


def test_parse_getfamily_reply() -> None:
    # Shaped like the kernel's ctrl_fill_info() for nbd: name, id (u16), version,
    # hdrsize, maxattr, ops, multicast groups; the ack follows in the same buffer.
    op = u16(8) + u16(1) + u32(1) + u16(8) + u16(2) + u32(0x0B)  # OP_ID, OP_FLAGS
    ops = u16(4 + 4 + len(op)) + u16(0x8006) + u16(4 + len(op)) + u16(0x8001) + op
    group = u16(8) + u16(2) + u32(7) + u16(17) + u16(1) + b"nbd_mc_group\0\0\0\0"
    groups = u16(4 + 4 + len(group)) + u16(0x8007) + u16(4 + len(group)) + u16(0x8001) + group
    attrs = (
        u16(8) + u16(2) + b"nbd\0"
        + u16(6) + u16(1) + u16(FAMILY) + b"\0\0"
        + u16(8) + u16(3) + u32(1)
        + u16(8) + u16(4) + u32(0)
        + u16(8) + u16(5) + u32(10)
        + ops
        + groups
    )  # fmt: skip
    reply = nlhdr(20 + len(attrs), 0x10, 0, 9, PORT_ID) + genlhdr(1, 2) + attrs
    messages = kernel.parse_nlmsgs(reply + ack(9))
    assert [m.type for m in messages] == [0x10, 0x2]
    assert kernel.parse_family(messages) == GenlFamily(
        id=FAMILY, name="nbd", version=1, mcast_groups={"nbd_mc_group": 7}
    )


def status_reply(seq: int, items: list[tuple[int, int]], nested_flag: int) -> bytes:
    body = b""
    for index, connected in items:
        fields = u16(8) + u16(1) + u32(index) + u16(5) + u16(2) + u8(connected) + b"\0\0\0"
        body += u16(4 + len(fields)) + u16(nested_flag | 1) + fields
    device_list = u16(4 + len(body)) + u16(nested_flag | 9) + body
    return nlhdr(20 + len(device_list), FAMILY, 0, seq, PORT_ID) + genlhdr(5, 1) + device_list


def test_parse_status_reply_as_the_kernel_sends_it() -> None:
    # populate_nbd_status() nests with nla_nest_start_noflag: no NLA_F_NESTED.
    raw = status_reply(4, [(0, 1), (1, 0), (15, 0)], nested_flag=0)
    assert len(raw) == 20 + 4 + 3 * 20
    expected = [DeviceStatus(0, True), DeviceStatus(1, False), DeviceStatus(15, False)]
    assert kernel.parse_status_reply(kernel.parse_nlmsgs(raw + ack(4)), FAMILY) == expected
    flagged = status_reply(4, [(0, 1), (1, 0), (15, 0)], nested_flag=0x8000)
    assert kernel.parse_status_reply(kernel.parse_nlmsgs(flagged), FAMILY) == expected
    assert expected[2].device == "/dev/nbd15"
    empty = status_reply(5, [], nested_flag=0)
    assert kernel.parse_status_reply(kernel.parse_nlmsgs(empty), FAMILY) == []


def test_parse_connect_reply_and_link_dead_notification() -> None:
    connect = nlhdr(28, FAMILY, 0, 7, PORT_ID) + genlhdr(1, 1) + u16(8) + u16(1) + u32(3)
    assert kernel.parse_connect_reply(kernel.parse_nlmsgs(connect + ack(7)), FAMILY) == 3
    with pytest.raises(NetlinkParseError):
        kernel.parse_connect_reply(kernel.parse_nlmsgs(ack(7)), FAMILY)
    dead = nlhdr(28, FAMILY, 0, 0, 0) + genlhdr(4, 1) + u16(8) + u16(1) + u32(2)
    assert kernel.parse_link_dead(kernel.parse_nlmsgs(dead + dead), FAMILY) == [2, 2]
    assert kernel.parse_link_dead(kernel.parse_nlmsgs(connect), FAMILY) == []


def test_parse_error_with_extended_ack_message() -> None:
    request = kernel.nbd_disconnect_request(FAMILY, 3, 4)  # echoed whole: not capped
    text = u16(4 + 30) + u16(1) + b"couldn't find device at index\0" + b"\0\0"
    payload = i32(-errno.EINVAL) + request + text
    error = nlhdr(16 + len(payload), 0x2, 0x200, 3, PORT_ID) + payload
    (msg,) = kernel.parse_nlmsgs(error)
    assert kernel.parse_nlmsgerr(msg) == (errno.EINVAL, "couldn't find device at index")
    capped = i32(-errno.EPERM) + request[:16] + u16(4 + 4) + u16(1) + b"no!\0"
    (msg,) = kernel.parse_nlmsgs(nlhdr(16 + len(capped), 0x2, 0x300, 3, PORT_ID) + capped)
    assert kernel.parse_nlmsgerr(msg) == (errno.EPERM, "no!")
    (msg,) = kernel.parse_nlmsgs(ack(3))
    assert kernel.parse_nlmsgerr(msg) == (0, "")


def test_generic_netlink_against_this_kernel_controller() -> None:
    """The real kernel answers the same GETFAMILY encoding: nlctrl is always there."""
    family = kernel.resolve_family("nlctrl")
    assert family.id == 0x10 and family.name == "nlctrl"
    assert "notify" in family.mcast_groups
    with pytest.raises(kernel.FamilyNotFound, match="'no-such-family'"):
        kernel.resolve_family("no-such-family")


# ------------------------------------------------------------------ ioctls


def test_ioctl_numbers_are_io_0xab_n() -> None:
    numbers = {
        "NBD_SET_SOCK": 0,
        "NBD_SET_BLKSIZE": 1,
        "NBD_SET_SIZE": 2,
        "NBD_DO_IT": 3,
        "NBD_CLEAR_SOCK": 4,
        "NBD_CLEAR_QUE": 5,
        "NBD_PRINT_DEBUG": 6,
        "NBD_SET_SIZE_BLOCKS": 7,
        "NBD_DISCONNECT": 8,
        "NBD_SET_TIMEOUT": 9,
        "NBD_SET_FLAGS": 10,
    }
    for name, nr in numbers.items():
        # _IO: no direction (0 << 30), no size (0 << 16), type 0xab << 8, number.
        assert getattr(kernel, name) == 0xAB00 | nr, name
    assert kernel.NBD_DO_IT == 0xAB03


def test_ioctl_setup_plan() -> None:
    plan = kernel.ioctl_setup_plan(
        size=10 << 30, block_size=512, server_flags=0x12D, sock_fd=7, io_timeout=30
    )
    assert plan == [
        ("NBD_SET_BLKSIZE", 0xAB01, 512),
        ("NBD_SET_SIZE", 0xAB02, 10 << 30),
        ("NBD_SET_FLAGS", 0xAB0A, 0x12D),
        ("NBD_SET_TIMEOUT", 0xAB09, 30),
        ("NBD_SET_SOCK", 0xAB00, 7),
    ]
    # Where unsigned long is 32 bits, sizes from 4 GiB go in blocks.
    narrow = kernel.ioctl_setup_plan(
        size=10 << 30, block_size=4096, server_flags=1, sock_fd=7, ulong_bytes=4
    )
    assert narrow[1] == ("NBD_SET_SIZE_BLOCKS", 0xAB07, (10 << 30) // 4096)
    assert [name for name, _, _ in narrow] == [
        "NBD_SET_BLKSIZE",
        "NBD_SET_SIZE_BLOCKS",
        "NBD_SET_FLAGS",
        "NBD_SET_SOCK",
    ]


# ---------------------------------------------------------- kernel headers


def _c_int(node: ast.expr, env: dict[str, int | str]) -> int:
    match node:
        case ast.Constant(value=int() as v):
            return v
        case ast.Name(id=name) if isinstance(env.get(name), int):
            value = env[name]
            assert isinstance(value, int)
            return value
        case ast.UnaryOp(op=ast.Invert(), operand=o):
            return ~_c_int(o, env)
        case ast.UnaryOp(op=ast.USub(), operand=o):
            return -_c_int(o, env)
        case ast.BinOp(left=a, op=op, right=b):
            x, y = _c_int(a, env), _c_int(b, env)
            ops = {ast.LShift: x << y, ast.BitOr: x | y, ast.BitAnd: x & y, ast.Add: x + y}
            if type(op) is ast.Sub:
                return x - y
            return ops[type(op)]
        case ast.Call(func=ast.Name(id="_IO"), args=[a, b]):
            # _IO(type, nr) = _IOC(_IOC_NONE, type, nr, 0), shifts from asm-generic/ioctl.h.
            return (
                _c_int(ast.Name("_IOC_NONE"), env) << _c_int(ast.Name("_IOC_DIRSHIFT"), env)
                | _c_int(a, env) << _c_int(ast.Name("_IOC_TYPESHIFT"), env)
                | _c_int(b, env) << _c_int(ast.Name("_IOC_NRSHIFT"), env)
            )
    raise ValueError(ast.dump(node))


def header_constants(path: Path, env: dict[str, int | str] | None = None) -> dict[str, int | str]:
    """#define NAME value and enum members of a C header, in order; unevaluable ones left out."""
    known: dict[str, int | str] = dict(env or {})
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    found: dict[str, int | str] = {}
    items: list[tuple[int, str, str | None, bool]] = []
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?!\()[ \t]+(.+?)[ \t]*$", text, re.M):
        items.append((m.start(), m.group(1), m.group(2), False))
    for m in re.finditer(r"\benum\b[^{;]*\{(.*?)\}", text, re.S):
        first = True
        for entry in m.group(1).split(","):
            entry = entry.strip()
            if entry:
                name, _, expr = entry.partition("=")
                items.append((m.start(), name.strip(), expr.strip() or None, first))
                first = False
    previous = -1
    for _, name, expr, first_in_enum in sorted(items, key=lambda i: i[0]):
        if first_in_enum:
            previous = -1
        try:
            if expr is None:  # enum member without a value
                value: int | str = previous + 1
            elif string := re.fullmatch(r'"([^"]*)"', expr):
                value = string.group(1)
            else:
                expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)
                value = _c_int(ast.parse(expr, mode="eval").body, known)
        except (ValueError, SyntaxError, KeyError):
            continue
        if isinstance(value, int):
            previous = value
        known[name] = found[name] = value
    return found


def _require(path: Path) -> Path:
    assert path.exists(), f"{path} missing: install linux-libc-dev (deploy/host/install-deps.sh)"
    return path


def test_nbd_netlink_header_matches_every_constant() -> None:
    parsed = header_constants(_require(NBD_NETLINK_H))
    checked = {n: v for n, v in parsed.items() if not n.startswith("__") and not n.endswith("_MAX")}
    assert len(checked) == 3 + 11 + 2 + 3 + 2 + 2 + 6  # strings/version, then each enum
    for name, value in checked.items():
        assert getattr(kernel, name) == value, name


def test_nbd_header_matches_every_constant() -> None:
    parsed = header_constants(_require(NBD_H), header_constants(_require(IOCTL_H)))
    wire = {
        # The transmission values the wire codec (nbd.constants) already owns.
        "NBD_CMD_READ": constants.Command.READ,
        "NBD_CMD_WRITE": constants.Command.WRITE,
        "NBD_CMD_DISC": constants.Command.DISC,
        "NBD_CMD_FLUSH": constants.Command.FLUSH,
        "NBD_CMD_TRIM": constants.Command.TRIM,
        "NBD_FLAG_HAS_FLAGS": TransmissionFlag.HAS_FLAGS,
        "NBD_FLAG_READ_ONLY": TransmissionFlag.READ_ONLY,
        "NBD_FLAG_SEND_FLUSH": TransmissionFlag.SEND_FLUSH,
        "NBD_FLAG_SEND_FUA": TransmissionFlag.SEND_FUA,
        "NBD_FLAG_SEND_TRIM": TransmissionFlag.SEND_TRIM,
        "NBD_FLAG_CAN_MULTI_CONN": TransmissionFlag.CAN_MULTI_CONN,
        "NBD_REQUEST_MAGIC": constants.REQUEST_MAGIC,
        "NBD_REPLY_MAGIC": constants.SIMPLE_REPLY_MAGIC,
        # The kernel's 32-bit request type is the codec's 16-bit flags then 16-bit type.
        "NBD_CMD_FLAG_FUA": constants.CommandFlag.FUA << 16,
    }
    assert len(parsed) == 11 + 5 + 6 + 1 + 2 + 2  # ioctls, cmds, flags, cmd flag, cflags, magics
    for name, value in parsed.items():
        mine = wire[name] if name in wire else getattr(kernel, name)
        assert mine == value, name


NETLINK_NAMES = [
    "NETLINK_GENERIC",
    "NLM_F_REQUEST",
    "NLM_F_MULTI",
    "NLM_F_ACK",
    "NLM_F_ROOT",
    "NLM_F_MATCH",
    "NLM_F_DUMP",
    "NLM_F_CAPPED",
    "NLM_F_ACK_TLVS",
    "NLMSG_NOOP",
    "NLMSG_ERROR",
    "NLMSG_DONE",
    "NLMSG_OVERRUN",
    "NLMSG_MIN_TYPE",
    "NLMSG_ALIGNTO",
    "NLA_ALIGNTO",
    "NLA_F_NESTED",
    "NLA_F_NET_BYTEORDER",
    "NLA_TYPE_MASK",
    "NETLINK_ADD_MEMBERSHIP",
    "NETLINK_DROP_MEMBERSHIP",
    "NETLINK_CAP_ACK",
    "NETLINK_EXT_ACK",
    "NLMSGERR_ATTR_MSG",
]
GENETLINK_NAMES = [
    "GENL_ID_CTRL",
    "CTRL_CMD_NEWFAMILY",
    "CTRL_CMD_GETFAMILY",
    "CTRL_ATTR_FAMILY_ID",
    "CTRL_ATTR_FAMILY_NAME",
    "CTRL_ATTR_VERSION",
    "CTRL_ATTR_HDRSIZE",
    "CTRL_ATTR_MAXATTR",
    "CTRL_ATTR_OPS",
    "CTRL_ATTR_MCAST_GROUPS",
    "CTRL_ATTR_MCAST_GRP_NAME",
    "CTRL_ATTR_MCAST_GRP_ID",
]


def test_netlink_and_genetlink_headers_match_the_values_used() -> None:
    netlink = header_constants(_require(NETLINK_H))
    genetlink = header_constants(_require(GENETLINK_H), netlink)
    for name in NETLINK_NAMES:
        value = netlink[name]
        assert isinstance(value, int)
        # NLA_TYPE_MASK is ~(...) in C: compare it as the 16-bit nla_type it masks.
        assert getattr(kernel, name) == (value & 0xFFFF if name == "NLA_TYPE_MASK" else value), name
    for name in GENETLINK_NAMES:
        assert getattr(kernel, name) == genetlink[name], name
    # SOL_NETLINK lives in the C library's <bits/socket.h>, not in the kernel's uapi.
    (bits_socket,) = INCLUDE.glob("*/bits/socket.h")
    assert header_constants(bits_socket)["SOL_NETLINK"] == kernel.SOL_NETLINK


def test_header_parser_reads_enums_and_defines() -> None:
    assert header_constants(_require(NBD_NETLINK_H))["NBD_ATTR_BACKEND_IDENTIFIER"] == 10
    ioctl = header_constants(_require(IOCTL_H))
    assert (ioctl["_IOC_TYPESHIFT"], ioctl["_IOC_DIRSHIFT"], ioctl["_IOC_NONE"]) == (8, 30, 0)


# ----------------------------------------------------------- probe, attach


def kernel_nbd_visible() -> bool:
    return (
        Path("/sys/module/nbd").exists()
        or any(re.fullmatch(r"nbd\d+", p.name) for p in Path("/dev").glob("nbd*"))
        or kernel._lookup_nbd_family()[0] is not None
    )


@pytest.fixture
def no_kernel_nbd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """This host as it is when it has no nbd driver (the CI kernel); hidden otherwise."""
    if kernel_nbd_visible():
        (tmp_path / "dev").mkdir()
        monkeypatch.setattr(kernel, "SYS_MODULE_NBD", tmp_path / "no-module")
        monkeypatch.setattr(kernel, "DEV_DIR", tmp_path / "dev")
        monkeypatch.setattr(
            kernel, "_lookup_nbd_family", lambda: (None, "generic netlink family 'nbd' hidden")
        )
        monkeypatch.setattr(kernel, "_modprobe", lambda: "hidden by the test")
    yield


def socketpair_negotiated(*, tls: bool = False) -> tuple[Negotiated, socket.socket]:
    a, b = socket.socketpair()
    flags = TransmissionFlag.HAS_FLAGS | TransmissionFlag.SEND_FLUSH
    return Negotiated(a, "disk", 1 << 20, flags, BlockSize(1, 4096, 1 << 25), tls), b


def children_of_this_process() -> set[str]:
    return {
        pid
        for task in Path(f"/proc/{os.getpid()}/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


def test_probe_reports_unavailable_on_this_host(no_kernel_nbd: None) -> None:
    available, reason = kernel.kernel_nbd_available()
    assert available is False
    assert reason.startswith("kernel nbd unavailable: no nbd module loaded and modprobe nbd failed")
    assert kernel.kernel_nbd_available(load_module=False) == (
        False,
        "kernel nbd unavailable: no nbd module loaded",
    )


def test_attach_kernel_raises_unavailable_without_side_effects(no_kernel_nbd: None) -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        negotiated.sock.settimeout(3.5)
        before = children_of_this_process()
        with pytest.raises(KernelNBDUnavailable, match="kernel nbd unavailable"):
            kernel.attach_kernel(negotiated, io_timeout=30, dead_conn_timeout=60)
        # The socket is untouched: open, same timeout, still carrying bytes both ways.
        assert negotiated.sock.fileno() >= 0 and negotiated.sock.gettimeout() == 3.5
        negotiated.sock.sendall(b"ping")
        assert peer.recv(4) == b"ping"
        peer.sendall(b"pong")
        assert negotiated.sock.recv(4) == b"pong"
        assert children_of_this_process() == before
        assert not list(kernel.DEV_DIR.glob("nbd[0-9]*"))
        assert kernel._do_it_children == {}


def test_other_kernel_operations_raise_unavailable(no_kernel_nbd: None) -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        with pytest.raises(KernelNBDUnavailable):
            kernel.detach_kernel("/dev/nbd0")
        with pytest.raises(KernelNBDUnavailable):
            kernel.reconnect_kernel("/dev/nbd0", negotiated)
        with pytest.raises(KernelNBDUnavailable):
            kernel.resize_kernel("/dev/nbd0", 1 << 30)
        with pytest.raises(KernelNBDUnavailable):
            kernel.kernel_status()
        with pytest.raises(KernelNBDUnavailable):
            kernel.LinkDeadMonitor()


def test_attach_kernel_refuses_a_tls_socket_before_probing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def probe(**_: object) -> kernel.KernelSupport:
        raise AssertionError("probed although the socket is TLS")

    monkeypatch.setattr(kernel, "probe_kernel_nbd", probe)
    negotiated, peer = socketpair_negotiated(tls=True)
    with negotiated.sock, peer:
        with pytest.raises(KernelNBDError, match="cannot speak TLS") as info:
            kernel.attach_kernel(negotiated)
        assert not isinstance(info.value, KernelNBDUnavailable)
    # An SSLSocket is refused even if the flag says otherwise.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    a, b = socket.socketpair()
    with b, ctx.wrap_socket(a, do_handshake_on_connect=False, server_hostname="x") as tls_sock:
        plain = Negotiated(tls_sock, "disk", 1 << 20, TransmissionFlag.HAS_FLAGS, None, False)
        with pytest.raises(KernelNBDError, match="cannot speak TLS"):
            kernel.attach_kernel(plain)


def test_probe_prefers_netlink_and_falls_back_to_ioctl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nbd0").touch()
    (dev / "nbd10").touch()
    (dev / "nbd1p1").touch()  # a partition, not a device
    monkeypatch.setattr(kernel, "DEV_DIR", dev)
    monkeypatch.setattr(kernel, "SYS_MODULE_NBD", tmp_path / "module")
    monkeypatch.setattr(kernel, "_modprobe", lambda: pytest.fail("modprobe with devices present"))
    monkeypatch.setattr(kernel, "_lookup_nbd_family", lambda: (None, "family 'nbd' absent"))
    support = kernel.probe_kernel_nbd()
    assert (support.netlink, support.ioctl, support.available) == (False, True, True)
    assert (
        support.reason == f"kernel nbd available through ioctl on {dev}/nbd0 (family 'nbd' absent)"
    )
    family = GenlFamily(FAMILY, "nbd", 1, {"nbd_mc_group": 7})
    monkeypatch.setattr(kernel, "_lookup_nbd_family", lambda: (family, ""))
    support = kernel.probe_kernel_nbd()
    assert (support.netlink, support.ioctl, support.family) == (True, True, family)
    assert kernel._nbd_devices() == [dev / "nbd0", dev / "nbd10"]


def test_kernel_block_size() -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        assert kernel.kernel_block_size(negotiated) == 512
        assert kernel.kernel_block_size(negotiated, 4096) == 4096
        strict = Negotiated(
            negotiated.sock,
            "d",
            1 << 20,
            TransmissionFlag(1),
            BlockSize(4096, 4096, 1 << 20),
            False,
        )
        assert kernel.kernel_block_size(strict) == 4096
        with pytest.raises(ValueError, match="below the server's minimum"):
            kernel.kernel_block_size(strict, 512)
        for bad in (1000, 256, 1 << 20):
            with pytest.raises(ValueError, match="power of two"):
                kernel.kernel_block_size(negotiated, bad)


def test_attach_kernel_refuses_a_server_maximum_below_the_drivers_requests(
    no_kernel_nbd: None,
) -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        small = Negotiated(
            negotiated.sock, "d", 1 << 20, TransmissionFlag(1), BlockSize(1, 4096, 1 << 22), False
        )
        with pytest.raises(KernelNBDError, match="maximum payload of 4194304 bytes") as info:
            kernel.attach_kernel(small)
        assert not isinstance(info.value, KernelNBDUnavailable)
        assert kernel.KERNEL_MAX_REQUEST == 32 * 1024 * 1024


def test_device_index() -> None:
    assert kernel.device_index("/dev/nbd0") == 0
    assert kernel.device_index("nbd12") == 12
    for bad in ("/dev/nbd", "/dev/loop0", "/dev/nbd1p1", "/tmp/nbd1"):
        with pytest.raises(ValueError):
            kernel.device_index(bad)


class FakeNetlink:
    """Stands in for the kernel: records requests, answers with canned replies."""

    sent: list[bytes] = []
    replies: list[bytes] = []

    def __init__(self, timeout: float = 10.0) -> None:
        pass

    def __enter__(self) -> FakeNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def transact(self, build: Callable[[int], bytes]) -> list[kernel.NetlinkMessage]:
        FakeNetlink.sent.append(build(42))
        return kernel.parse_nlmsgs(b"".join(FakeNetlink.replies))


@pytest.fixture
def fake_netlink(monkeypatch: pytest.MonkeyPatch) -> type[FakeNetlink]:
    family = GenlFamily(FAMILY, "nbd", 1, {"nbd_mc_group": 7})
    support = kernel.KernelSupport(True, True, "test", family)
    monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: support)
    monkeypatch.setattr(kernel, "_lookup_nbd_family", lambda: (family, ""))
    monkeypatch.setattr(kernel, "GenericNetlink", FakeNetlink)
    FakeNetlink.sent, FakeNetlink.replies = [], []
    return FakeNetlink


def test_attach_kernel_sends_connect_for_the_negotiated_socket(
    fake_netlink: type[FakeNetlink],
) -> None:
    connect_reply = nlhdr(28, FAMILY, 0, 42, PORT_ID) + genlhdr(1, 1) + u16(8) + u16(1) + u32(3)
    fake_netlink.replies = [connect_reply]
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        device = kernel.attach_kernel(negotiated, io_timeout=30, dead_conn_timeout=60)
        assert device == "/dev/nbd3"
        assert fake_netlink.sent == [
            nlhdr(96, FAMILY, 5, 42)
            + genlhdr(1, 1)
            + u16(12) + u16(2) + u64(1 << 20)  # the negotiated size
            + u16(12) + u16(3) + u64(512)
            + u16(12) + u16(5) + u64(0x05)  # HAS_FLAGS | SEND_FLUSH as negotiated
            + u16(12) + u16(4) + u64(30)
            + u16(12) + u16(8) + u64(60)
            + u16(16) + u16(0x8007) + u16(12) + u16(0x8001)
            + u16(8) + u16(1) + u32(negotiated.sock.fileno())
        ]  # fmt: skip
        kernel.detach_kernel(device)
        assert fake_netlink.sent[1] == kernel.nbd_disconnect_request(FAMILY, 42, 3)
        kernel.reconnect_kernel(device, negotiated, backend_identifier="b")
        assert fake_netlink.sent[2] == kernel.nbd_reconfigure_request(
            FAMILY, 42, 3, sock_fds=[negotiated.sock.fileno()], backend_identifier="b"
        )


def test_kernel_status_parses_the_reply(fake_netlink: type[FakeNetlink]) -> None:
    fake_netlink.replies = [status_reply(42, [(0, 1), (1, 0)], nested_flag=0)]
    assert kernel.kernel_status() == [DeviceStatus(0, True), DeviceStatus(1, False)]
    assert fake_netlink.sent == [kernel.nbd_status_request(FAMILY, 42)]


def test_ioctl_attach_configures_then_reports_a_failed_do_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The ioctl path: setup ioctls in order on the device, then NBD_DO_IT in a child.

    The "device" is a regular file, so the real child's NBD_DO_IT fails (ENOTTY)
    and its stderr comes back in the error.
    """
    dev, sys_block = tmp_path / "dev", tmp_path / "sys-block"
    dev.mkdir()
    (dev / "nbd0").touch()
    (sys_block / "nbd0").mkdir(parents=True)
    (sys_block / "nbd0" / "size").write_text("0\n")
    monkeypatch.setattr(kernel, "DEV_DIR", dev)
    monkeypatch.setattr(kernel, "SYS_BLOCK", sys_block)
    support = kernel.KernelSupport(False, True, "test")
    monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: support)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(kernel, "_ioctl", lambda fd, request, arg: calls.append((request, arg)))
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        failed = re.escape(f"NBD_DO_IT failed on {dev}/nbd0: NBD_DO_IT on {dev}/nbd0: ")
        with pytest.raises(KernelNBDError, match=failed + r"\[Errno 25\] Inappropriate ioctl"):
            kernel.attach_kernel(negotiated, io_timeout=30)
        assert calls == [
            (0xAB01, 512),
            (0xAB02, 1 << 20),
            (0xAB0A, 0x05),
            (0xAB09, 30),
            (0xAB00, negotiated.sock.fileno()),
        ]
    assert kernel._do_it_children == {}

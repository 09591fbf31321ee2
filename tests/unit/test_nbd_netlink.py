"""Generic netlink (``nbd.netlink``, ``nbd.netlink_socket``): encodings, byte for byte.

The expected bytes are assembled by hand, field by field, without the
module's struct formats (``tests/netlink_bytes.py``).  Every uapi value the
module hard-codes is also checked against the installed kernel headers
(``linux-libc-dev``, installed by deploy/host/install-deps.sh).
"""

from __future__ import annotations

import errno

import pytest

# Bound as ``kernel``: these tests were written when the codec was part of
# nbd.kernel, and their assertions are kept exactly as they were written.
from nbd import netlink as kernel
from nbd.kernel_ioctl import NBD_CFLAG_DESTROY_ON_DISCONNECT
from nbd.netlink import DeviceStatus, GenlFamily, NetlinkParseError
from nbd.netlink_socket import resolve_family
from tests.kernel_headers import (
    GENETLINK_H,
    INCLUDE,
    IOCTL_H,
    NBD_NETLINK_H,
    NETLINK_H,
    _require,
    header_constants,
)
from tests.netlink_bytes import FAMILY, PORT_ID, genlhdr, i32, nlhdr, status_reply, u16, u32, u64

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
        client_flags=NBD_CFLAG_DESTROY_ON_DISCONNECT,
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
    family = resolve_family("nlctrl")
    assert family.id == 0x10 and family.name == "nlctrl"
    assert "notify" in family.mcast_groups
    with pytest.raises(kernel.FamilyNotFound, match="'no-such-family'"):
        resolve_family("no-such-family")


def test_nbd_netlink_header_matches_every_constant() -> None:
    parsed = header_constants(_require(NBD_NETLINK_H))
    checked = {n: v for n, v in parsed.items() if not n.startswith("__") and not n.endswith("_MAX")}
    assert len(checked) == 3 + 11 + 2 + 3 + 2 + 2 + 6  # strings/version, then each enum
    for name, value in checked.items():
        assert getattr(kernel, name) == value, name


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

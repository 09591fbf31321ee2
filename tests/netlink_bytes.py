"""Netlink messages assembled by hand, field by field, in host byte order (as netlink
is), without the codec's struct formats: what the tests expect the codec to send, and
the replies they feed it as the kernel would."""

from __future__ import annotations

import sys

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


def status_reply(seq: int, items: list[tuple[int, int]], nested_flag: int) -> bytes:
    body = b""
    for index, connected in items:
        fields = u16(8) + u16(1) + u32(index) + u16(5) + u16(2) + u8(connected) + b"\0\0\0"
        body += u16(4 + len(fields)) + u16(nested_flag | 1) + fields
    device_list = u16(4 + len(body)) + u16(nested_flag | 9) + body
    return nlhdr(20 + len(device_list), FAMILY, 0, seq, PORT_ID) + genlhdr(5, 1) + device_list

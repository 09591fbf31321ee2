"""The supervisor's probes: the RPC NULL readiness probe and the TCP check."""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial

import pytest
import trio

from backend.ganesha.probes import NFS_PROGRAM, accepts_tcp, rpc_ping

Reply = Callable[[int, int, int], bytes]


def accepted(xid: int, program: int, version: int, accept_stat: int = 0) -> bytes:
    body = struct.pack(">6I", xid, 1, 0, 0, 0, accept_stat)
    return struct.pack(">I", 0x80000000 | len(body)) + body


async def serve_once(reply: Reply, nursery: trio.Nursery) -> int:
    """A one-shot RPC server on loopback; returns its port."""

    async def handler(stream: trio.SocketStream) -> None:
        data = b""
        while len(data) < 44:
            chunk = await stream.receive_some()
            if not chunk:
                return
            data += chunk
        _, xid, msg_type, rpcvers, program, version, procedure = struct.unpack(">7I", data[:28])
        assert (msg_type, rpcvers, procedure) == (0, 2, 0)
        answer = reply(xid, program, version)
        if answer:
            await stream.send_all(answer)
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, host="127.0.0.1"), handler, 0)
    return int(listeners[0].socket.getsockname()[1])


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (lambda xid, p, v: accepted(xid, p, v), True),
        (lambda xid, p, v: accepted(xid + 1, p, v), False),  # not our call
        (lambda xid, p, v: accepted(xid, p, v, accept_stat=1), False),  # PROG_UNAVAIL
        (
            lambda xid, p, v: struct.pack(">7I", 0x80000018, xid, 1, 1, 0, 2, 2),
            False,  # MSG_DENIED, RPC_MISMATCH
        ),
        (lambda xid, p, v: b"", False),  # closed without a word
    ],
)
async def test_rpc_ping_is_true_only_for_an_accepted_null_reply(
    reply: Reply, expected: bool
) -> None:
    async with trio.open_nursery() as nursery:
        port = await serve_once(reply, nursery)
        assert await rpc_ping("127.0.0.1", port, NFS_PROGRAM, 3) is expected
        nursery.cancel_scope.cancel()


async def test_rpc_ping_gives_up_on_a_silent_server() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, host="127.0.0.1"), silent, 0)
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(5):
            assert await rpc_ping("127.0.0.1", port, timeout=0.3) is False
        nursery.cancel_scope.cancel()


async def test_nothing_listening_is_neither_accepting_nor_answering() -> None:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        assert await accepts_tcp("127.0.0.1", port) is False
        assert await rpc_ping("127.0.0.1", port) is False

"""The reply thread of a plain-socket connection (nbd.sender.ThreadedReplies).

Real sockets and a real thread: what matters is what arrives on the other
end, in which order, and that the thread always lets go of the socket.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import threading
from pathlib import Path

import trio
import trio.testing

from nbd.iov import consume
from nbd.sender import ThreadedReplies, WriteJob
from nbd.transport import PeerClosed


def _pair() -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    a, b = trio.socket.socketpair()
    # A small send buffer makes the sender wait for room quickly.
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    return a, b


async def _read(sock: trio.socket.SocketType, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = await sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name == "nbd-send"}


async def test_replies_arrive_whole_and_in_queue_order() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    sent: list[int] = []
    expected = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replies.run)
        for i in range(200):
            head = i.to_bytes(4, "big")
            body = bytes([i % 251]) * (1000 + i * 37)
            expected += head + body
            await replies.put([head, body], functools.partial(sent.append, i))
        got = await _read(b, len(expected))
        replies.close()
    assert got == bytes(expected)
    assert sent == list(range(200))
    a.close()
    b.close()


async def test_write_job_runs_in_the_thread_before_its_reply(tmp_path: Path) -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    target = tmp_path / "file"
    target.write_bytes(bytes(8192))
    calls: list[tuple[str, int, int]] = []
    fd = os.open(target, os.O_RDWR)

    def write(views: list[memoryview], offset: int) -> None:
        calls.append((threading.current_thread().name, offset, sum(len(v) for v in views)))
        os.pwritev(fd, views, offset)

    def fail(e: OSError) -> bytes:
        return b"failed"

    try:
        async with trio.open_nursery() as nursery:
            # Queue the writes before the thread runs, so it finds them together.
            for i in range(4):
                job = WriteJob(
                    write, i * 2048, memoryview(bytes([i + 1]) * 2048), b"ok%d;" % i, fail
                )
                await replies.put_write(job)
            nursery.start_soon(replies.run)
            got = await _read(b, len(b"ok0;ok1;ok2;ok3;"))
            replies.close()
    finally:
        os.close(fd)
    assert got == b"ok0;ok1;ok2;ok3;"
    # Adjacent writes to one file were made in one call, from the thread.
    assert calls == [("nbd-send", 0, 8192)]
    assert target.read_bytes() == b"".join(bytes([i + 1]) * 2048 for i in range(4))
    a.close()
    b.close()


async def test_failed_merged_write_is_retried_alone_so_each_gets_its_answer() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    calls: list[tuple[int, int]] = []

    def write(views: list[memoryview], offset: int) -> None:
        calls.append((offset, sum(len(v) for v in views)))
        if offset <= 4096 < offset + sum(len(v) for v in views):
            raise OSError(errno.ENOSPC, "no space")

    def fail(e: OSError) -> bytes:
        return b"E%d;" % (e.errno or 0)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            job = WriteJob(write, i * 4096, memoryview(bytes(4096)), b"ok%d;" % i, fail)
            await replies.put_write(job)
        nursery.start_soon(replies.run)
        expected = b"ok0;E%d;ok2;" % errno.ENOSPC
        got = await _read(b, len(expected))
        replies.close()
    assert got == expected
    assert calls == [(0, 12288), (0, 4096), (4096, 4096), (8192, 4096)]
    a.close()
    b.close()


async def test_put_waits_while_more_than_the_limit_is_unsent() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a, limit=64 * 1024)
    queued = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replies.run)

        async def producer() -> None:
            nonlocal queued
            for _ in range(64):
                await replies.put([bytes(16 * 1024)])
                queued += 1

        nursery.start_soon(producer)
        # Nobody reads: the socket buffers fill, then the queue, then put waits.
        await trio.sleep(0.5)
        assert queued < 64, "put never waited for the peer"
        stalled_at = queued
        got = await _read(b, 64 * 16 * 1024)  # the peer reads: everything flows again
        assert len(got) == 64 * 16 * 1024
        assert queued == 64 > stalled_at
        replies.close()
    a.close()
    b.close()


async def test_peer_gone_ends_run_with_peer_closed_and_later_puts_return() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    b.close()
    caught: list[PeerClosed] = []

    async def runner() -> None:
        try:
            await replies.run()
        except PeerClosed as e:
            caught.append(e)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner)
        for _ in range(100):
            await replies.put([bytes(64 * 1024)])
            if replies.dead:
                break
            await trio.sleep(0.01)
    assert replies.dead
    assert caught, "run() did not report the peer's going"
    with trio.fail_after(1):
        await replies.put([b"after the end"])  # returns at once: nobody to send to
    assert "nbd-send" not in _threads()
    a.close()


async def test_cancelled_while_the_peer_does_not_read_stops_the_thread() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    with trio.move_on_after(0.5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(replies.run)
            for _ in range(1000):
                await replies.put([bytes(64 * 1024)])
    assert scope.cancelled_caught
    # run() returned only after the thread let go of the socket.
    assert "nbd-send" not in _threads()
    a.close()
    b.close()


async def test_close_sends_everything_queued_before_it() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    data = bytes(range(256)) * 4096  # 1 MiB, more than the socket holds
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replies.run)
        await replies.put([data])
        replies.close()
        got = await _read(b, len(data))
    assert got == data
    assert "nbd-send" not in _threads()
    a.close()
    b.close()


def test_consume_drops_what_a_vectored_write_took() -> None:
    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"h")]
    consume(views, 0)
    assert [bytes(v) for v in views] == [b"abc", b"defg", b"h"]
    consume(views, 4)  # all of the first, part of the second
    assert [bytes(v) for v in views] == [b"efg", b"h"]
    consume(views, 3)  # exactly one whole view
    assert [bytes(v) for v in views] == [b"h"]
    consume(views, 1)
    assert views == []


async def test_send_now_leaves_what_the_socket_refuses_to_go_first() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    big = bytes(range(256)) * 2048  # 512 KiB: more than the socket takes at once
    later = b"after-the-batch"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replies.run)
        await trio.testing.wait_all_tasks_blocked()
        scratch = bytearray(big)
        assert replies.send_now(memoryview(scratch))
        scratch[:] = bytes(len(scratch))  # the caller may reuse its buffer at once
        # The socket is taken until the rest of the batch is out.
        assert not replies.send_now(memoryview(bytearray(b"x")))
        await replies.put([later])
        got = await _read(b, len(big) + len(later))
        replies.close()
    assert got == big + later
    assert not replies._sending.locked()  # given back once the rest was out
    a.close()
    b.close()


async def test_send_now_gives_way_while_the_thread_sends() -> None:
    a, b = _pair()
    replies = ThreadedReplies(a)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replies.run)
        with replies._sending:  # as the thread holds it for its own send
            assert not replies.send_now(memoryview(bytearray(b"reply")))
        assert replies.send_now(memoryview(bytearray(b"reply")))
        assert await _read(b, 5) == b"reply"
        replies.close()
    a.close()
    b.close()

"""nbd.control (the listener ↔ worker messages) and nbd.shared (what processes share)."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from ipaddress import ip_network
from pathlib import Path

import pytest
import trio
import trio.testing

from nbd import control
from nbd.exports import Export, ExportTable
from nbd.shared import SharedRegion
from nbd.throttle import BURST_SECONDS, Throttle


def test_export_round_trips() -> None:
    export = Export(
        "vol-1@node",
        Path("/pool/vol-1.img"),
        read_only=True,
        description="a volume",
        allowed_clients=frozenset({ip_network("10.0.0.0/8"), ip_network("fd00::/8")}),
        tls_required=True,
        min_block_size=4096,
        iops_limit=100,
        bandwidth_limit=1 << 20,
    )
    wire = control.decode(
        control.encode({"op": "export", "export": control.export_to_wire(export)}),
        control.OPS_TO_WORKER,
    )
    assert control.export_from_wire(wire["export"]) == export
    anyone = Export("x", Path("/x"))
    assert control.export_from_wire(control.export_to_wire(anyone)) == anyone


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"[]", b'{"op": "nonsense"}', b'{"seq": 1}', b'{"op": "ack"}'],
)
def test_messages_that_do_not_decode_are_refused(data: bytes) -> None:
    with pytest.raises(control.ControlError):
        control.decode(data, control.OPS_TO_WORKER)


@pytest.mark.parametrize(
    "change",
    [
        {"name": "bad name!"},
        {"min_block_size": 3},
        {"iops_limit": -1},
        {"iops_limit": True},
        {"read_only": "yes"},
        {"allowed_clients": ["not-a-network"]},
        {"path": None},
    ],
)
def test_invalid_exports_are_refused(change: dict[str, object]) -> None:
    wire = control.export_to_wire(Export("x", Path("/x"))) | change
    with pytest.raises(control.ControlError):
        control.export_from_wire(wire)


def test_an_export_missing_a_field_is_refused() -> None:
    wire = control.export_to_wire(Export("x", Path("/x")))
    del wire["tls_required"]
    with pytest.raises(control.ControlError, match="tls_required"):
        control.export_from_wire(wire)


def test_a_message_too_long_is_refused() -> None:
    with pytest.raises(control.ControlError):
        control.encode({"op": "sync", "pad": "x" * control.MAX_MESSAGE})


async def test_messages_and_descriptors_cross_the_channel(tmp_path: Path) -> None:
    ours, theirs = control.socketpair()
    a = trio.socket.from_stdlib_socket(ours)
    b = trio.socket.from_stdlib_socket(theirs)
    payload = tmp_path / "f"
    payload.write_bytes(b"handed over")
    fd = os.open(payload, os.O_RDONLY)
    try:
        await control.send(a, {"op": "conn"}, [fd])
        await control.send(a, {"op": "sync", "seq": 7})
        got = await control.receive(b, control.OPS_TO_WORKER)
        assert got is not None
        msg, fds = got
        assert msg == {"op": "conn"} and len(fds) == 1
        assert os.pread(fds[0], 64, 0) == b"handed over"
        assert not os.get_inheritable(fds[0])
        os.close(fds[0])
        assert await control.receive(b, control.OPS_TO_WORKER) == ({"op": "sync", "seq": 7}, [])
        # The listener's messages are not the worker's.
        await control.send(b, {"op": "conn"})
        with pytest.raises(control.ControlError):
            await control.receive(a, control.OPS_TO_LISTENER)
        a.close()
        assert await control.receive(b, control.OPS_TO_WORKER) is None
    finally:
        os.close(fd)
        a.close()
        b.close()


async def test_a_refused_message_closes_the_descriptors_it_carried(tmp_path: Path) -> None:
    ours, theirs = control.socketpair()
    with ours, theirs:
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            payload = b'{"op": "bogus"}'
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))]
            ours.sendmsg([payload], ancillary)
        finally:
            os.close(fd)
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(control.ControlError):
            await control.receive(trio.socket.from_stdlib_socket(theirs), control.OPS_TO_WORKER)
        assert set(os.listdir("/proc/self/fd")) <= before


# ------------------------------------------------------------------ shared


def test_counters_of_every_process_add_up() -> None:
    region = SharedRegion.create(processes=3, slots=4)
    try:
        for process, n in enumerate((5, 7, 11)):
            row = region.row(2, process)
            row.requests += n
            row.read_bytes += n * 4096
            row.service_ns += n * 1000
            row.connections += 1
        # Another mapping of the same memory (as a worker has) sees them.
        other = SharedRegion(region.fd, 4, 3)
        sums, connections = other.totals(2)
        assert sums == {
            "requests": 23,
            "read_bytes": 23 * 4096,
            "written_bytes": 0,
            "errors": 0,
            "service_ns": 23000,
        }
        assert connections == 3
        assert other.totals(1) == (dict.fromkeys(sums, 0), 0)
        region.clear(2)
        assert other.totals(2) == (dict.fromkeys(sums, 0), 0)
        with pytest.raises(IndexError):
            region.row(4, 0)
        with pytest.raises(IndexError):
            region.row(0, 3)
    finally:
        region.close()


def test_a_shared_export_counts_connections_in_its_row(tmp_path: Path) -> None:
    from nbd.exports import ExportRuntime
    from nbd.shared import SharedExport

    region = SharedRegion.create(processes=2, slots=2)
    try:
        row = region.row(1, 1)
        runtime = ExportRuntime(region.throttle(1), row, SharedExport(region, 1, row))  # type: ignore[arg-type]
        table = ExportTable()
        export = Export("d", tmp_path)
        table.add(export, runtime)
        scope = trio.CancelScope()
        assert table.open_connection(export, scope) is runtime
        row.requests += 3
        ((name, stats, connections),) = table.stats()
        assert (name, stats.requests, connections) == ("d", 3, 1)
        table.remove("d")  # the connection ends after its export went
        assert scope.cancel_called
        table.close_connection(export, scope, runtime)
        assert region.connections(1) == 0
    finally:
        region.close()


def test_throttles_on_shared_cells_take_from_the_same_buckets() -> None:
    """Two throttles over one slot, as two processes have: the limit holds for both."""

    async def main() -> float:
        region = SharedRegion.create(processes=2, slots=1)
        cells = region.throttle(0)._cells
        first = Throttle(cells=cells, clock=trio.current_time, configure=False)
        second = Throttle(cells=cells, clock=trio.current_time, configure=False)
        first.configure(iops=100, bandwidth=0)
        assert second.iops == 100
        second.reload()  # as a worker does when told of the change
        assert not second.unlimited
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for t in (first, second):

                async def take(t: Throttle = t) -> None:
                    for _ in range(100):
                        await t.admit(4096)

                nursery.start_soon(take)
        elapsed = trio.current_time() - start
        second.configure(0, 0)
        first.reload()
        assert first.unlimited
        region.close()
        return elapsed

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # 200 requests at 100/s between them: 2 s, less the starting burst.
    assert 2.0 - BURST_SECONDS - 0.02 <= elapsed <= 2.0 + 0.02, elapsed


def test_the_slot_lock_excludes_another_process() -> None:
    region = SharedRegion.create(processes=2, slots=2)
    try:
        assert not _locked_elsewhere(region.fd, 1)
        with region.throttle(1)._lock:
            assert _locked_elsewhere(region.fd, 1)
            assert not _locked_elsewhere(region.fd, 0)  # another slot is free
        assert not _locked_elsewhere(region.fd, 1)
    finally:
        region.close()


def _locked_elsewhere(fd: int, slot: int) -> bool:
    """Whether another process could not take the slot's lock now."""
    import fcntl

    from nbd.shared import STRIDE
    from nbd.throttle import CELLS_BYTES

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, CELLS_BYTES, slot * STRIDE, os.SEEK_SET)
            os.write(w, b"0")
        except OSError:
            os.write(w, b"1")
        os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return answer == b"1"


def test_a_shared_table_tells_its_watcher_every_change(tmp_path: Path) -> None:
    """What the listener passes on to its workers: adds, limit changes, removals."""
    from nbd.exports import ExportRuntime, private_runtime

    told: list[tuple[str, int, bool]] = []
    made: list[str] = []

    def factory(export: Export) -> ExportRuntime:
        made.append(export.name)
        return private_runtime(export)

    table = ExportTable([Export("a", tmp_path)])
    watcher = lambda e, r, present: told.append((e.name, e.iops_limit, present))  # noqa: E731
    table.share(factory, watcher)
    assert made == ["a"] and told == [("a", 0, True)]
    table.add(Export("b", tmp_path))
    table.add(Export("b", tmp_path))  # the same again: nothing to tell
    table.add(Export("b", tmp_path, iops_limit=5))  # limits only: same runtime
    runtime = table.runtime("b")
    assert runtime is not None and runtime.throttle.iops == 5
    table.add(Export("b", tmp_path, read_only=True))  # replaced: removed, then added
    table.remove("a")
    assert told[1:] == [
        ("b", 0, True),
        ("b", 5, True),
        ("b", 5, False),
        ("b", 0, True),
        ("a", 0, False),
    ]
    assert made == ["a", "b", "b"]
    table.unshare(watcher)
    table.add(Export("c", tmp_path))
    assert len(told) == 6 and made == ["a", "b", "b"]


@contextlib.contextmanager
def out_of_descriptors() -> Iterator[None]:
    """No new descriptor can be made in this process (EMFILE) until the end."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_socket_that_cannot_be_received_loses_one_connection_not_the_channel(
    tmp_path: Path,
) -> None:
    ours, theirs = control.socketpair()
    a = trio.socket.from_stdlib_socket(ours)
    b = trio.socket.from_stdlib_socket(theirs)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        await control.send(a, {"op": "conn"}, [fd])
        await control.send(a, {"op": "conn"}, [fd])
        with out_of_descriptors():
            got = await control.receive(b, control.OPS_TO_WORKER)
        assert got == ({"op": "conn"}, [])
        got = await control.receive(b, control.OPS_TO_WORKER)
        assert got is not None and got[0] == {"op": "conn"} and len(got[1]) == 1
        os.close(got[1][0])
        # Anything else that lost its descriptors is still refused.
        await control.send(a, {"op": "config"}, [fd])
        with out_of_descriptors(), pytest.raises(control.ControlError):
            await control.receive(b, control.OPS_TO_WORKER)
    finally:
        os.close(fd)
        a.close()
        b.close()


async def test_a_worker_says_closed_for_a_connection_that_did_not_arrive() -> None:
    from nbd.server import NBDServer
    from nbd.worker import _Worker

    ours, theirs = control.socketpair()
    region = SharedRegion.create(processes=2, slots=4)
    listener = trio.socket.from_stdlib_socket(ours)
    worker = _Worker(trio.socket.from_stdlib_socket(theirs), NBDServer(ExportTable()), region, 1)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run, nursery)
            await control.send(listener, {"op": "conn"})  # its socket lost on the way
            with trio.fail_after(10):
                got = await control.receive(listener, control.OPS_TO_LISTENER)
            assert got == ({"op": "closed"}, [])
            nursery.cancel_scope.cancel()
    finally:
        listener.close()
        worker.sock.close()
        region.close()


def test_a_worker_raises_its_descriptor_limit() -> None:
    """In a child given finite limits of its own (soft 256, hard 1024), whatever this
    process's limits are: the worker's start takes the soft limit up to the hard one."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))

    script = (
        "import resource\n"
        "from nbd.worker import raise_fd_limit\n"
        "raise_fd_limit()\n"
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.split() == ["1024", "1024"]


async def test_a_release_right_behind_its_hold_ends_it_in_the_worker() -> None:
    """A hold and its release queued back to back (a respawned worker, a listener
    that gave up waiting): the worker applies them in channel order, so no hold
    is left in force.  When the hold was placed in a task of its own, trio ran
    the release first in about half of these rounds, and the hold then stopped
    the images' I/O for its whole lease."""
    from nbd.server import NBDServer
    from nbd.worker import _Worker

    for round_ in range(24):
        ours, theirs = control.socketpair()
        region = SharedRegion.create(processes=2, slots=4)
        listener = trio.socket.from_stdlib_socket(ours)
        server = NBDServer(ExportTable())
        worker = _Worker(trio.socket.from_stdlib_socket(theirs), server, region, 1)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run, nursery)
                hold = {"op": "hold", "id": "h", "paths": ["/x"], "lease": 60, "timeout": 10}
                await control.send(listener, hold)
                await control.send(listener, {"op": "release", "id": "h"})
                await control.send(listener, {"op": "sync", "seq": 1})
                answers: list[control.Message] = []
                with trio.fail_after(10):
                    while len(answers) < 2:  # the hold's answer and the sync's ack
                        got = await control.receive(listener, control.OPS_TO_LISTENER)
                        assert got is not None
                        answers.append(got[0])
                assert {m["op"] for m in answers} == {"held", "ack"}
                assert not server.holds, f"round {round_}: the hold outlived its release"
                nursery.cancel_scope.cancel()
        finally:
            listener.close()
            worker.sock.close()
            region.close()


async def test_a_bad_hold_is_answered_and_places_nothing() -> None:
    from nbd.server import NBDServer
    from nbd.worker import _Worker

    ours, theirs = control.socketpair()
    region = SharedRegion.create(processes=2, slots=4)
    listener = trio.socket.from_stdlib_socket(ours)
    server = NBDServer(ExportTable())
    worker = _Worker(trio.socket.from_stdlib_socket(theirs), server, region, 1)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run, nursery)
            bad = {"op": "hold", "id": "h", "paths": ["/x"], "lease": 0, "timeout": 10}
            await control.send(listener, bad)
            with trio.fail_after(10):
                got = await control.receive(listener, control.OPS_TO_LISTENER)
            assert got is not None
            msg, _ = got
            assert msg["op"] == "held" and msg["id"] == "h"
            assert "bad hold message" in str(msg["error"])
            assert not server.holds
            nursery.cancel_scope.cancel()
    finally:
        listener.close()
        worker.sock.close()
        region.close()

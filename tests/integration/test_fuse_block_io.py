"""The FUSE block path's I/O set-up, against moorage's own NBD server.

- The loop device runs in direct-I/O mode over the FUSE file (no second page
  cache), and what is written through it with O_DIRECT is what an NBD client
  reads from the export, byte for byte, and the other way round.
- With ``workers`` > 1, several processes serve the FUSE file (cloned
  ``/dev/fuse`` descriptors, NBD connections of their own): the bytes are
  still the export's both ways, each process takes requests, a refresh
  reaches every one, a worker that is killed is replaced and its requests
  fail instead of hanging, and workers end with the mounting process.
- A server that stops answering (SIGSTOP: its connections stay open, nothing
  comes back) fails a request with EIO after the I/O timeout: the export's
  watchdog, not a timer per request, declares the connection lost.  Once the
  server runs again, I/O works again.

Every wait is bounded (threads joined with a timeout, reads retried until a
deadline); the stack's teardown leaves no mount, loop device or process.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fuse.blockdev import attach_fuse_block, detach_fuse_block, refresh_size
from fuse.blockfile import stop_bound
from fuse.loop import loop_status
from fuse.nbdconnections import watch_period
from hostio.mountinfo import read_mountinfo, topmost
from nbd.libnbd import NBDClient
from tests.conftest import (
    NBDServerFactory,
    NBDServerProcess,
    free_port,
    run,
    sparse_image,
    stop_process,
    wait_for_port,
)
from tests.fuse_block_stack import IMAGE_SIZE, BlockStack, MiB, mkfs, reads_again

TIMEOUT = 2.0  # the I/O timeout of the stalled-server test
PROMPTLY = 60.0  # far above TIMEOUT + the watchdog period + a reconnect attempt


@pytest.fixture
def server(nbd_servers: NBDServerFactory, tmp_path: Path) -> NBDServerProcess:
    return nbd_servers.start({"disk": sparse_image(tmp_path / "disk.img", IMAGE_SIZE)})


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BlockStack]:
    s = BlockStack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def aligned(data: bytes) -> mmap.mmap:
    """``data`` in page-aligned memory, as O_DIRECT wants it."""
    buf = mmap.mmap(-1, len(data))
    buf.write(data)
    return buf


@pytest.mark.parametrize(
    ("workers", "nbd_client", "kind"),
    [
        (1, "auto", "pipelined"),
        (2, "auto", "pipelined"),
        (1, "libnbd", "libnbd"),
        (2, "libnbd", "libnbd"),
    ],
)
def test_loop_device_is_direct_io_and_its_bytes_are_the_exports(
    server: NBDServerProcess, stack: BlockStack, workers: int, nbd_client: str, kind: str
) -> None:
    """Both NBD clients of the block file (``--nbd-client auto``, the default:
    nbd.pipeline on a plain socket; ``libnbd``, what TLS uses) carry the bytes both
    ways, and every process serving the mount (workers too) uses the one chosen."""
    attachment = stack.attach(server.uri("disk"), workers=workers, nbd_client=nbd_client)
    assert len(_processes(attachment.pid, workers)) == workers
    log_file = Path(attachment.log_file)

    def told() -> list[str]:  # each process logs its client once connected
        return re.findall(r"connection\(s\), (\w+) client$", log_file.read_text(), re.M)

    deadline = time.monotonic() + PROMPTLY
    while len(told()) < workers:
        assert time.monotonic() < deadline, log_file.read_text()
        time.sleep(0.05)
    assert told() == [kind] * workers, told()
    status = loop_status(attachment.device)
    assert status is not None and status.direct_io, status
    name = os.path.basename(attachment.device)
    assert Path(f"/sys/block/{name}/loop/dio").read_text().strip() == "1"
    _bytes_both_ways(attachment.device, server.uri("disk"))


def test_the_pipelined_client_over_a_unix_socket(stack: BlockStack, tmp_path: Path) -> None:
    """nbd+unix:// is plain too: the pipelined client, the bytes both ways."""
    sock = tmp_path / "nbd.sock"
    image = sparse_image(tmp_path / "unix.img", IMAGE_SIZE)
    argv = [sys.executable, "-m", "moorage", "nbd", "serve", "--export", f"disk={image}"]
    with (tmp_path / "unix-server.log").open("wb") as out:
        proc = subprocess.Popen([*argv, "--unix", str(sock)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + PROMPTLY
        while not sock.is_socket():
            assert proc.poll() is None, (tmp_path / "unix-server.log").read_text()
            assert time.monotonic() < deadline, "no unix socket"
            time.sleep(0.05)
        uri = f"nbd+unix:///disk?socket={sock}"
        attachment = stack.attach(uri)
        assert "pipelined client" in Path(attachment.log_file).read_text()
        _bytes_both_ways(attachment.device, uri)
        stack.detach(attachment)
    finally:
        stop_process(proc, 20)


def _bytes_both_ways(device: str, uri: str) -> None:
    """What is written through ``device`` with O_DIRECT is what an NBD client reads from
    the export at ``uri``, byte for byte, and the other way round."""
    # through the loop device (O_DIRECT, scattered 4 KiB and 1 MiB writes) -> the export
    pieces = {offset: os.urandom(4096) for offset in range(0, 64 * 4096, 2 * 4096)}
    pieces[8 * MiB] = os.urandom(MiB)
    fd = os.open(device, os.O_RDWR | os.O_DIRECT)
    try:
        for offset, data in pieces.items():
            with aligned(data) as buf:
                assert os.pwritev(fd, [buf], offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    with NBDClient.open(uri, meta_contexts=()) as client:
        for offset, data in pieces.items():
            assert client.pread(len(data), offset) == data, f"offset {offset}"
        # the export -> through the loop device
        back = os.urandom(2 * MiB)
        client.pwrite(back, 32 * MiB)
        client.flush()
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(-1, len(back)) as buf:
            assert os.preadv(fd, [buf], 32 * MiB) == len(back)
            assert buf[:] == back
    finally:
        os.close(fd)


def test_the_mount_looks_as_it_did_under_libfuse(
    server: NBDServerProcess, stack: BlockStack
) -> None:
    """mount(2) with libfuse's options: the source, type and options findmnt shows (and
    the cleanup code matches) are what pyfuse3's mount gave."""
    uri = server.uri("disk")
    attachment = stack.attach(uri)
    entry = topmost(read_mountinfo(), attachment.mountpoint)
    assert entry is not None
    assert entry.fstype == "fuse.moorage-nbd"
    assert entry.source == f"moorage-nbd:{uri}"
    assert {"nosuid", "nodev"} <= set(entry.mount_options)
    assert set(entry.super_options) == {"rw", "user_id=0", "group_id=0", "default_permissions"}


def test_a_server_that_stops_answering_fails_io_after_the_timeout(
    server: NBDServerProcess, stack: BlockStack
) -> None:
    uri = server.uri("disk")
    stack.attached.append(uri)
    attachment = attach_fuse_block(uri, stack.state_dir, timeout=TIMEOUT)
    data = os.urandom(4096)
    fd = os.open(attachment.file, os.O_RDWR)
    try:
        os.pwrite(fd, data, 0)
        outcome: dict[str, Any] = {}

        def read() -> None:
            started = time.monotonic()
            try:
                outcome["data"] = os.pread(fd, 4096, 0)
            except OSError as e:
                outcome["errno"] = e.errno
            outcome["seconds"] = time.monotonic() - started

        server.signal_all(signal.SIGSTOP)
        try:
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(PROMPTLY)
            assert not reader.is_alive(), "a read from a server that stopped answering hung"
        finally:
            server.signal_all(signal.SIGCONT)
        assert outcome.get("errno") == errno.EIO, outcome
        # not before the timeout, and not long after it (plus a reconnect attempt)
        assert TIMEOUT * 0.9 <= outcome["seconds"] <= TIMEOUT + watch_period(TIMEOUT) + 15
        reads_again(fd, data, within=30)
    finally:
        os.close(fd)
    assert "no reply within" in Path(attachment.log_file).read_text()


# ------------------------------------------------------------------ several processes


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def _processes(pid: int, count: int, within: float = PROMPTLY) -> list[int]:
    """The mounting process and its workers, once there are ``count`` of them."""
    deadline = time.monotonic() + within
    while True:
        found = [pid, *_children(pid)]
        if len(found) == count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} processes, not {count}: {found}"
        time.sleep(0.1)


def _logged(log_file: str, text: str, within: float = PROMPTLY) -> None:
    deadline = time.monotonic() + within
    while text not in Path(log_file).read_text():
        assert time.monotonic() < deadline, f"{text!r} not logged within {within}s"
        time.sleep(0.1)


def _read_calls(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("syscr:")).split()[1])


def _hammer(device: str, seconds: float, errors: list[BaseException], threads: int = 8) -> None:
    """4 KiB O_DIRECT reads and writes from several threads (many requests in flight)."""
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        fd = os.open(device, os.O_RDWR | os.O_DIRECT)
        try:
            with mmap.mmap(-1, 4096) as buf:
                i = 0
                while time.monotonic() < stop:
                    offset = ((k * 7919 + i * 104729) % (IMAGE_SIZE // 4096)) * 4096
                    try:
                        if i % 2:
                            os.pwritev(fd, [buf], offset)
                        else:
                            os.preadv(fd, [buf], offset)
                    except OSError as e:
                        errors.append(e)
                    i += 1
        finally:
            os.close(fd)

    workers = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(seconds + PROMPTLY)
        assert not t.is_alive(), "I/O on the loop device hung"


def _round_trip(device: str, uri: str, offset: int) -> None:
    """1 MiB through the loop device read back through the export, and the other way."""
    data = os.urandom(MiB)
    fd = os.open(device, os.O_RDWR | os.O_DIRECT)
    try:
        for k in range(0, MiB, 64 * 1024):  # many requests: every process gets some
            with aligned(data[k : k + 64 * 1024]) as buf:
                assert os.pwritev(fd, [buf], offset + k) == 64 * 1024
        os.fsync(fd)
        with NBDClient.open(uri, meta_contexts=()) as client:
            assert client.pread(MiB, offset) == data
            back = os.urandom(MiB)
            client.pwrite(back, offset + MiB)
            client.flush()
        with mmap.mmap(-1, 4096) as buf:
            for k in range(0, MiB, 4096):
                assert os.preadv(fd, [buf], offset + MiB + k) == 4096
                assert buf[:] == back[k : k + 4096], f"offset {offset + MiB + k}"
    finally:
        os.close(fd)


def test_every_process_takes_requests(server: NBDServerProcess, stack: BlockStack) -> None:
    attachment = stack.attach(server.uri("disk"), workers=2)
    processes = _processes(attachment.pid, 2)
    before = {pid: _read_calls(pid) for pid in processes}
    errors: list[BaseException] = []
    _hammer(attachment.device, 3.0, errors)
    assert not errors, errors[:3]
    grew = {pid: _read_calls(pid) - before[pid] for pid in processes}
    # each process read requests from /dev/fuse (a read(2) each, and more)
    assert all(count > 50 for count in grew.values()), grew
    _round_trip(attachment.device, server.uri("disk"), 16 * MiB)


def test_a_refresh_reaches_every_process(
    server: NBDServerProcess, stack: BlockStack, tmp_path: Path
) -> None:
    attachment = stack.attach(server.uri("disk"), workers=2)
    _processes(attachment.pid, 2)
    _logged(attachment.log_file, "worker 1 INFO serving")  # connected at the old size
    os.truncate(tmp_path / "disk.img", IMAGE_SIZE + 64 * MiB)
    assert refresh_size(attachment) == IMAGE_SIZE + 64 * MiB
    # past the old end, through whichever process takes each request
    _round_trip(attachment.device, server.uri("disk"), IMAGE_SIZE + 32 * MiB)
    log = Path(attachment.log_file).read_text()
    assert log.count(f"export size {IMAGE_SIZE} -> {IMAGE_SIZE + 64 * MiB}") == 2, log


def test_a_killed_worker_is_replaced_and_its_requests_fail_not_hang(
    server: NBDServerProcess, stack: BlockStack
) -> None:
    attachment = stack.attach(server.uri("disk"), workers=2)
    _, worker = _processes(attachment.pid, 2)
    errors: list[BaseException] = []
    hammer = threading.Thread(target=_hammer, args=(attachment.device, 4.0, errors))
    hammer.start()
    time.sleep(1.0)
    os.kill(worker, signal.SIGKILL)
    hammer.join(4.0 + 2 * PROMPTLY)
    assert not hammer.is_alive()
    # what the dead worker had taken failed (EIO), nothing else
    assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in errors), errors[:3]
    _, replaced = _processes(attachment.pid, 2)
    assert replaced != worker
    assert "starting another" in Path(attachment.log_file).read_text()
    _round_trip(attachment.device, server.uri("disk"), 24 * MiB)


def test_workers_end_with_the_mounting_process(server: NBDServerProcess, stack: BlockStack) -> None:
    uri = server.uri("disk")
    attachment = stack.attach(uri, workers=2)
    _, worker = _processes(attachment.pid, 2)
    os.kill(attachment.pid, signal.SIGKILL)
    deadline = time.monotonic() + PROMPTLY
    while _alive(worker):
        assert time.monotonic() < deadline, "a worker outlived the mounting process"
        time.sleep(0.1)
    assert detach_fuse_block(uri, stack.state_dir)
    stack.attached.remove(uri)
    assert loop_status(attachment.device) is None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------ nbdkit: flushes, multi-conn


@contextlib.contextmanager
def _nbdkit(tmp_path: Path, *filters: str, log_first: bool = False) -> Iterator[tuple[str, Path]]:
    """nbdkit serving a sparse image with its log filter (every command, one line at
    its start): (the URI, the log).  ``filters``: more ``--filter=`` arguments, before
    the log filter (closer to the client: the log sees what they let through), or
    after it with ``log_first`` (the log sees a command as it arrives)."""
    image = sparse_image(tmp_path / "nbdkit.img", IMAGE_SIZE)
    log = tmp_path / "nbdkit-commands.log"
    port = free_port()
    argv = ["nbdkit", "--foreground", "--exit-with-parent", "-i", "127.0.0.1", "-p", str(port)]
    stack = [*filters, "log"] if not log_first else ["log", *filters]
    argv += [f"--filter={f}" for f in stack]
    argv += ["file", str(image), f"logfile={log}", *_FILTER_ARGS[filters]]
    with (tmp_path / "nbdkit.out").open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out)
    try:
        wait_for_port(port, proc)
        yield f"nbd://127.0.0.1:{port}", log
    finally:
        stop_process(proc, 10)


_FILTER_ARGS: dict[tuple[str, ...], list[str]] = {
    (): [],
    ("multi-conn",): ["multi-conn-mode=disable"],
    # 4 KiB minimum, 64 KiB maximum, anything else refused with EINVAL
    # writes answered 5 s late: one is still in flight after a stop's 3 s of grace
    ("delay",): ["delay-write=5"],
    ("blocksize-policy",): [
        "blocksize-minimum=4096",
        "blocksize-maximum=65536",
        "blocksize-error-policy=error",
    ],
}


def _flushes(log: Path) -> int:
    """FLUSH commands the server received (its log has a line as each one starts)."""
    return sum(1 for line in log.read_text().splitlines() if " Flush id=" in line)


def _received(log: Path, command: str, offset: int) -> int:
    """How many times the server has logged ``command`` at ``offset``."""
    line = re.compile(rf" {command} id=\d+ offset={offset:#x} ")
    return len(line.findall(log.read_text() if log.exists() else ""))


def _arrived(log: Path, command: str, offset: int, within: float = PROMPTLY) -> None:
    """Until the server has logged ``command`` at ``offset`` (as it arrives, with the
    log filter first)."""
    deadline = time.monotonic() + within
    while not _received(log, command, offset):
        assert time.monotonic() < deadline, f"no {command} at {offset:#x} within {within}s"
        time.sleep(0.02)


def test_with_workers_every_fsync_reaches_the_server_as_a_flush(
    stack: BlockStack, tmp_path: Path
) -> None:
    """Two processes serve the mount; the kernel gives each request to either, so an
    FSYNC may reach a process that did not take the writes before it.  Each FSYNC must
    still be an NBD FLUSH at the server (the writes are durable when it returns), and
    so must a close and the unmount, whichever process took the writes."""
    rounds, threads = 24, 4
    with _nbdkit(tmp_path) as (uri, log):
        attachment = stack.attach(uri, workers=2)
        _processes(attachment.pid, 2)
        disk = os.path.join(attachment.mountpoint, "disk")
        fds = [os.open(disk, os.O_RDWR) for _ in range(threads)]
        errors: list[BaseException] = []

        def writer(k: int) -> None:
            try:
                for i in range(rounds):
                    offset = (k * rounds + i) * 8192
                    assert os.pwrite(fds[k], os.urandom(4096), offset) == 4096
                    os.fsync(fds[k])
            except BaseException as e:
                errors.append(e)

        try:
            before = _flushes(log)
            writer(0)  # one at a time
            team = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
            for t in team:  # and concurrently: requests spread over both processes
                t.start()
            for t in team:
                t.join(PROMPTLY)
            assert not any(t.is_alive() for t in team) and not errors, errors
            # the log line of a FLUSH is written as it starts, before it is answered
            flushed = _flushes(log) - before
        finally:
            for fd in fds:
                os.close(fd)
        fsyncs = rounds * (threads + 1)
        assert flushed >= fsyncs, f"{flushed} FLUSH commands for {fsyncs} fsync calls"
        stack.detach(attachment)
        last = _flushes(log)
        assert last > before + flushed  # the final flush at unmount (and close's FLUSH)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopped_process_flushes_what_it_acknowledged(
    stack: BlockStack, tmp_path: Path, workers: int
) -> None:
    """A raw loop device sends no FLUSH when it is let go: the FUSE process's final
    flush is what makes its acknowledged writes durable.  It is told to stop while a
    write the server answers late is in flight (nbdkit logged it on arrival); that
    write fails after the stop's grace (not sent again on another connection), and
    the final FLUSH still reaches the server and is answered, with workers too (where
    the mounting process flushes only once they have ended)."""
    with _nbdkit(tmp_path, "delay", log_first=True) as (uri, log):
        attachment = stack.attach(uri, workers=workers)
        _processes(attachment.pid, workers)
        fd = os.open(attachment.device, os.O_RDWR | os.O_DIRECT)
        outcome: list[BaseException | int] = []

        def write_late() -> None:
            try:
                with aligned(os.urandom(4096)) as buf:
                    outcome.append(os.pwritev(fd, [buf], 4 * MiB))
            except OSError as e:
                outcome.append(e)

        late = threading.Thread(target=write_late, daemon=True)
        try:
            with aligned(os.urandom(65536)) as buf:
                assert os.pwritev(fd, [buf], 0) == 65536  # acknowledged
            before = _flushes(log)
            late.start()
            _arrived(log, "Write", 4 * MiB)  # in flight at the server (answered 5 s late)
            assert late.is_alive()
            os.kill(attachment.pid, signal.SIGTERM)
            started = time.monotonic()
            bound = stop_bound(workers)
            while _alive(attachment.pid) and time.monotonic() - started < bound:
                time.sleep(0.05)
            assert not _alive(attachment.pid), f"still running {bound:.0f} s after SIGTERM"
            late.join(PROMPTLY)
            assert not late.is_alive() and isinstance(outcome[0], OSError), outcome
        finally:
            os.close(fd)
        text = Path(attachment.log_file).read_text(errors="replace")
        assert "the last flush" not in text, text  # neither failed nor unanswered
        assert _flushes(log) > before
        # failed once the grace closed its connection, not sent again on another one
        assert _received(log, "Write", 4 * MiB) == 1
        stack.detach(attachment)


def test_without_multi_conn_one_process_serves(stack: BlockStack, tmp_path: Path) -> None:
    """A server without multi-conn: a FLUSH covers only its own connection's writes, so
    ``--workers 2`` is one process, said in the log, and I/O works."""
    with _nbdkit(tmp_path, "multi-conn") as (uri, _):
        with NBDClient.open(uri, meta_contexts=()) as client:
            assert not client.can_multi_conn()
        attachment = stack.attach(uri, workers=2)
        _logged(attachment.log_file, "does not advertise multi-conn: one process serves")
        assert _children(attachment.pid) == []
        data = os.urandom(MiB)
        fd = os.open(os.path.join(attachment.mountpoint, "disk"), os.O_RDWR)
        try:
            assert os.pwrite(fd, data, 4 * MiB) == len(data)
            os.fsync(fd)
            assert os.pread(fd, len(data), 4 * MiB) == data
        finally:
            os.close(fd)
        assert _children(attachment.pid) == []
        stack.detach(attachment)


def test_a_servers_maximum_block_size_is_honoured(stack: BlockStack, tmp_path: Path) -> None:
    """nbdkit advertising a 64 KiB maximum and a 4 KiB minimum, and refusing whatever
    breaks them with EINVAL: the loop device's 1 MiB requests reach it in parts (the
    pipelined client splits them), and the bytes go both ways whole."""
    with _nbdkit(tmp_path, "blocksize-policy") as (uri, log):
        attachment = stack.attach(uri)  # --nbd-client auto: the pipelined client
        data = os.urandom(4 * MiB)
        fd = os.open(attachment.device, os.O_RDWR | os.O_DIRECT)
        try:
            with aligned(data) as buf:
                assert os.pwritev(fd, [buf], 8 * MiB) == len(data)
            os.fsync(fd)
            with mmap.mmap(-1, len(data)) as buf:
                assert os.preadv(fd, [buf], 8 * MiB) == len(data)
                assert buf[:] == data
        finally:
            os.close(fd)
        with (tmp_path / "nbdkit.img").open("rb") as image:
            image.seek(8 * MiB)
            assert image.read(len(data)) == data  # what the server stored
        sizes = [
            int(count, 16)
            for count in re.findall(
                r" (?:Read|Write) id=\d+ offset=0x[0-9a-f]+ count=0x([0-9a-f]+)", log.read_text()
            )
        ]
        assert sizes and max(sizes) == 65536, sorted(set(sizes))
        stack.detach(attachment)


def test_a_servers_minimum_block_size_is_the_loop_devices(
    stack: BlockStack, tmp_path: Path
) -> None:
    """nbdkit refusing anything not aligned to 4 KiB (EINVAL): the loop device has
    4 KiB logical blocks, as a kernel nbd device would, so a 512-byte direct write is
    refused at the device, and mkfs.ext4 on it makes a filesystem whose data comes
    back from the server whole (before, the device had 512-byte sectors: such I/O
    reached the server and failed with EIO)."""
    with _nbdkit(tmp_path, "blocksize-policy") as (uri, _):
        attachment = stack.attach(uri)
        name = os.path.basename(attachment.device)
        queue = Path(f"/sys/block/{name}/queue")
        assert (queue / "logical_block_size").read_text().strip() == "4096"
        fd = os.open(attachment.device, os.O_RDWR | os.O_DIRECT)
        try:
            with aligned(bytes(4096)) as buf, pytest.raises(OSError) as refused:
                os.pwritev(fd, [memoryview(buf)[:512]], 0)
            assert refused.value.errno == errno.EINVAL
        finally:
            os.close(fd)
        mkfs("ext4", attachment.device)
        target = stack.mount(attachment.device, "ext4")
        data = os.urandom(3 * MiB + 512)
        with (target / "file.bin").open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        stack.umount(target)
        stack.detach(attachment)
        attachment = stack.attach(uri)  # what is read now comes from the server
        run(["e2fsck", "-f", "-n", attachment.device])
        target = stack.mount(attachment.device, "ext4")
        assert (target / "file.bin").read_bytes() == data
        stack.umount(target)
        stack.detach(attachment)

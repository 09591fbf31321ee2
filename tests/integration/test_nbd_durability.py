"""Acknowledged FLUSHes and FUA writes survive ``kill -9`` of the server.

A SIGKILL loses whatever the server still holds in its own memory, never the
kernel's page cache; the second half of durability (the page cache reaching
the disk) is the server asking the kernel for it before it answers.  So each
test watches the server with strace: by the time the client has the reply to
a FLUSH (or a FUA write), a sync of the image (fdatasync, fsync, syncfs, or a
RWF_DSYNC/RWF_SYNC write) must have completed in the server.  Then the server
is killed with the client still connected, the image file is checked byte for
byte, and a fresh server on the same image serves the data back to qemu-io.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import NBDServerFactory, NBDServerProcess, sparse_image
from tests.nbd_tools import (
    FLUSH,
    FUA,
    NO_HOLE,
    TIMEOUT,
    WRITE,
    WRITE_ZEROES,
    MiB,
    QemuIOSession,
    Sent,
    nbd_target,
    qemu_io,
    read_range,
)

# A completed call that makes written data durable.
_SYNC = re.compile(
    r"^(?:\d+\s+)?(?:(?:fdatasync|fsync|syncfs)\(.*\)\s+= 0$"
    r"|pwritev2\(.*RWF_D?SYNC.*\)\s+= \d+$"
    r"|<\.\.\. (?:fdatasync|fsync|syncfs) resumed>.*= 0$)",
    re.MULTILINE,
)


class SyncWatch:
    """strace attached to a running server, counting completed sync calls."""

    def __init__(self, pid: int, log: Path) -> None:
        self.log = log
        self.err = log.with_suffix(".err")
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    "strace",
                    "-f",
                    "-qq",
                    "-e",
                    "trace=fdatasync,fsync,syncfs,pwritev2",
                    "-o",
                    str(log),
                    "-p",
                    str(pid),
                ],
                stderr=err,
            )
        # strace has attached once the tracee's status shows a tracer.
        deadline = time.monotonic() + TIMEOUT
        while not self._traced(pid):
            assert self.proc.poll() is None, self.err.read_text()
            assert time.monotonic() < deadline, "strace did not attach"
            time.sleep(0.02)

    @staticmethod
    def _traced(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        match = re.search(r"^TracerPid:\s+(\d+)$", status, re.MULTILINE)
        return match is not None and match.group(1) != "0"

    def count(self) -> int:
        return len(_SYNC.findall(self.log.read_text() if self.log.exists() else ""))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_watched(
    nbd_servers: NBDServerFactory, img: Path, tmp_path: Path
) -> tuple[NBDServerProcess, SyncWatch]:
    server = nbd_servers.start({"d": img})
    return server, SyncWatch(server.proc.pid, tmp_path / f"strace-{server.port}.log")


def _kill(server: NBDServerProcess) -> None:
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL


Region = tuple[int, int, int]  # offset, length, byte


def _check_after_restart(
    nbd_servers: NBDServerFactory, img: Path, regions: list[Region], size: int
) -> None:
    """The image file, then a fresh server on it, hold the regions (later ones win), zeroes
    elsewhere."""
    expected = bytearray(size)
    for offset, length, byte in regions:
        expected[offset : offset + length] = bytes([byte]) * length
    assert read_range(img, 0, size) == bytes(expected)
    server = nbd_servers.start({"d": img})
    # Between consecutive region edges the expected content is one repeated byte.
    edges = sorted({0, size, *(o for o, _, _ in regions), *(o + n for o, n, _ in regions)})
    checks = [f"read -P {expected[a]:#x} {a} {b - a}" for a, b in itertools.pairwise(edges)]
    qemu_io(nbd_target(server.uri("d")), *checks)


def test_flushed_writes_survive_sigkill(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    size = 32 * MiB
    img = sparse_image(tmp_path / "d.img", size)
    server, watch = _start_watched(nbd_servers, img, tmp_path)
    client = QemuIOSession(server.uri("d"), tmp_path / "client.trace")
    rounds: list[list[Region]] = [
        # Small and unaligned (inline path), 1 MiB, and one past the inline limit.
        [(0, 4096, 0x11), (5000, 777, 0x12), (MiB, MiB, 0x13), (4 * MiB, 6 * MiB, 0x14)],
        [(12 * MiB + 1, 4095, 0x21), (16 * MiB, 2 * MiB, 0x22), (31 * MiB, MiB, 0x23)],
    ]
    try:
        for regions in rounds:
            for offset, length, byte in regions:
                client.cmd(f"write -P {byte:#x} {offset} {length}")
            syncs = watch.count()
            client.cmd("flush")
            # The FLUSH reply is out only after a sync of the image completed.
            assert watch.count() > syncs, watch.log.read_text()
        sent = client.trace()
        writes = [s for s in sent if s.type == WRITE]
        assert len(writes) == sum(len(r) for r in rounds)
        assert not [w for w in writes if w.flags & FUA], writes
        assert sent.count(Sent(FLUSH, 0, 0, 0)) == len(rounds)
        # Right after the acknowledged FLUSH, with the client still connected.
        _kill(server)
    finally:
        watch.stop()
        client.close()
    _check_after_restart(nbd_servers, img, [r for rnd in rounds for r in rnd], size)


def test_fua_writes_survive_sigkill(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    size = 32 * MiB
    img = sparse_image(tmp_path / "d.img", size)
    server, watch = _start_watched(nbd_servers, img, tmp_path)
    client = QemuIOSession(server.uri("d"), tmp_path / "client.trace")
    regions: list[Region] = [
        (0, 4096, 0x31),
        (8192 + 3, 1000, 0x32),
        (2 * MiB, MiB, 0x33),
        (8 * MiB, 8 * MiB, 0x34),
        (30 * MiB, 2 * MiB, 0x35),
    ]
    try:
        for offset, length, byte in regions:
            syncs = watch.count()
            client.cmd(f"write -f -P {byte:#x} {offset} {length}")
            assert watch.count() > syncs, (offset, watch.log.read_text())
        # A FUA write of zeroes over part of an acknowledged region.
        syncs = watch.count()
        client.cmd(f"write -z -f {9 * MiB} {MiB}")
        assert watch.count() > syncs, watch.log.read_text()
        sent = client.trace()
        writes = [s for s in sent if s.type == WRITE]
        assert len(writes) == len(regions)
        assert all(w.flags & FUA for w in writes), writes
        assert Sent(WRITE_ZEROES, 9 * MiB, MiB, FUA | NO_HOLE) in sent
        assert not [s for s in sent if s.type == FLUSH], sent
        _kill(server)
    finally:
        watch.stop()
        client.close()
    expected = [*regions, (9 * MiB, MiB, 0)]
    _check_after_restart(nbd_servers, img, expected, size)


def test_sync_watch_sees_syncs(tmp_path: Path) -> None:
    """The strace watcher itself: a process that does not sync is not counted as syncing."""
    script = (
        "import os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "line = sys.stdin.readline()\n"
        "os.pwrite(fd, b'x' * 4096, 0)\n"
        "if line.strip() == 'sync':\n"
        "    os.fdatasync(fd)\n"
        "print('done', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    for mode, expected in (("nosync", 0), ("sync", 1)):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / f"{mode}.bin")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        watch = SyncWatch(proc.pid, tmp_path / f"{mode}.strace")
        try:
            proc.stdin.write(f"{mode}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"
            assert watch.count() == expected, watch.log.read_text()
        finally:
            watch.stop()
            proc.stdin.close()
            proc.wait(TIMEOUT)
            proc.stdout.close()
    assert os.path.getsize(tmp_path / "sync.bin") == 4096

"""moorage's NBD server against qemu-nbd and nbdkit, with the same clients on the same image.

Run with ``make bench``.  One 1 GiB image of random data, kept in the page
cache, is served by all three servers at once (each on its own loopback
port); one client runs at a time, and the same client commands measure:

- sequential read: ``nbdcopy nbd://... null:``, best of 3, MB/s (10^6 bytes/s);
- sequential write: ``nbdcopy SRC nbd://...`` from another 1 GiB random file,
  best of 3, MB/s;
- 4 KiB random read and write: fio's ``nbd`` engine, queue depth 32, one
  connection, 10 s per run, best of 2, IOPS;
- memory: a fresh server process driven over 8 connections at once (fio with
  8 jobs, small and large blocks, then nbdcopy with 8 connections both ways);
  the peak VmRSS sampled from /proc while they run and VmHWM at the end.

The repeated runs are interleaved (moorage, qemu-nbd, nbdkit, then rotated),
so that other load on the machine falls on all three alike.  Before timing,
each server must read back the image exactly and write a whole copy exactly.

Nothing here asserts a speed: the test fails only if a run fails or the data
read back or written is wrong.  The figures are printed as a table with the
ratios moorage/qemu-nbd and moorage/nbdkit and the targets; see
docs/performance.md.

Why this file is long: it is one benchmark (a single test) and the rest is its harness:
the three servers' command lines and settings, the correctness checks run before timing,
the fio and nbdcopy workloads, the memory sampler and the table of results.
test_attach_bench.py imports its server helpers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hostio.atomicfile import fsync_path
from tests.bench.harness import (
    EXPORT,
    Server,
    ServerSpec,
    moorage_argv,
    ratio,
    serving,
    version,
)
from tests.conftest import REPO, run

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

CHUNK = 8 << 20
# The published figures use the defaults; the overrides are for trying the harness out.
IMAGE_SIZE = int(os.environ.get("MOORAGE_BENCH_IMAGE_MIB", "1024")) * (1 << 20)
FIO_RUNTIME = int(os.environ.get("MOORAGE_BENCH_FIO_SECONDS", "10"))
RSS_FIO_RUNTIME = max(1, FIO_RUNTIME // 2)
SEQ_RUNS = 3
FIO_ROUNDS = 2
CONNECTIONS = 8
MiB = 1 << 20

TOOLS = ("qemu-nbd", "nbdkit", "nbdcopy", "nbdinfo", "fio")


# ------------------------------------------------------------------ servers


def qemu_nbd_argv(port: int, image: Path) -> list[str]:
    # Page cache (writeback, no O_DIRECT), blocking I/O in a thread pool, several
    # clients allowed: with --shared > 1 qemu-nbd advertises multi-conn.
    return [
        "qemu-nbd",
        "-f",
        "raw",
        "-x",
        EXPORT,
        "-b",
        "127.0.0.1",
        "-p",
        str(port),
        "--persistent",
        f"--shared={2 * CONNECTIONS}",
        "--cache=writeback",
        "--aio=threads",
        str(image),
    ]


def nbdkit_argv(port: int, image: Path) -> list[str]:
    # The file plugin's defaults: page cache, parallel thread model, 16 threads,
    # multi-conn advertised.
    return [
        "nbdkit",
        "-f",
        "--exit-with-parent",
        "-i",
        "127.0.0.1",
        "-p",
        str(port),
        "-e",
        EXPORT,
        "file",
        str(image),
    ]


SERVERS = (
    ServerSpec("moorage", moorage_argv),
    ServerSpec("qemu-nbd", qemu_nbd_argv),
    ServerSpec("nbdkit", nbdkit_argv),
)


# ------------------------------------------------------------------- images


@dataclass(frozen=True)
class Images:
    image: Path  # what the servers export
    pristine: Path  # the image's content before each server's correctness check
    source: Path  # what the sequential write copies in


def fill_random(path: Path, size: int) -> None:
    with path.open("wb") as f:
        for start in range(0, size, CHUNK):
            f.write(os.urandom(min(CHUNK, size - start)))
        f.flush()
        os.fsync(f.fileno())


def overwrite(dst: Path, src: Path) -> None:
    """Rewrite ``dst`` in place (same inode, blocks stay allocated) and sync it."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with src.open("rb", buffering=0) as fin, dst.open("r+b", buffering=0) as fout:
        while n := fin.readinto(buf):
            fout.write(view[:n])
        os.fsync(fout.fileno())


def warm(path: Path) -> None:
    """Read the whole file once so that it sits in the page cache."""
    buf = bytearray(CHUNK)
    with path.open("rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def same_content(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(CHUNK), fb.read(CHUNK)
            if x != y:
                return False
            if not x:
                return True


@pytest.fixture
def peer_tools() -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing peer tools: {', '.join(missing)} (make host installs them)")
    engines = run(["fio", "--enghelp"], check=False).stdout
    if "nbd" not in engines.split():
        pytest.skip("this fio has no nbd ioengine")


@pytest.fixture
def images(peer_tools: None, tmp_path: Path) -> Iterator[Images]:
    imgs = Images(tmp_path / "bench.img", tmp_path / "pristine.img", tmp_path / "src.img")
    try:
        fill_random(imgs.pristine, IMAGE_SIZE)
        fill_random(imgs.source, IMAGE_SIZE)
        shutil.copyfile(imgs.pristine, imgs.image)
        fsync_path(imgs.image)
        yield imgs
    finally:
        # pytest keeps the last few tmp_path directories: do not leave 3 GiB behind.
        for p in (imgs.image, imgs.pristine, imgs.source):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- workloads


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    run(argv, timeout=600)
    return time.perf_counter() - start


def check_read_back(server: Server, expected: Path) -> None:
    """Stream the whole export through nbdcopy and compare it with ``expected``."""
    with (
        expected.open("rb") as want,
        subprocess.Popen(
            ["nbdcopy", server.uri, "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as proc,
    ):
        assert proc.stdout is not None and proc.stderr is not None
        offset = 0
        while True:
            got = proc.stdout.read(CHUNK)
            if not got or got != want.read(len(got)):
                break
            offset += len(got)
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace")
        rc = proc.wait(600)
    assert offset == IMAGE_SIZE, f"{server.name}: data read back differs after byte {offset}"
    assert rc == 0, f"nbdcopy from {server.name} exited {rc}: {err}"


def fio(
    uri: str,
    rw: str,
    *,
    bs: str = "4k",
    iodepth: int = 32,
    numjobs: int = 1,
    runtime: int = FIO_RUNTIME,
) -> dict[str, Any]:
    """Run fio's nbd engine against ``uri``; the (group-reported) job's JSON."""
    argv = [
        "fio",
        "--name=bench",
        "--ioengine=nbd",
        f"--uri={uri}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--iodepth={iodepth}",
        f"--numjobs={numjobs}",
        "--group_reporting",
        # The nbd engine opens no local file, so no client-side cache is in play;
        # the servers all go through the page cache.
        "--direct=1",
        "--norandommap",
        f"--size={IMAGE_SIZE}",
        f"--runtime={runtime}",
        "--time_based",
        "--output-format=json",
    ]
    out = run(argv, timeout=runtime + 120).stdout
    # The nbd engine prints "fio: connected to NBD server" before the JSON.
    report = json.loads(out[out.index("{") :])
    job: dict[str, Any] = report["jobs"][0]
    assert job["error"] == 0, f"fio {rw} against {uri}: error {job['error']}"
    return job


def fio_iops(uri: str, rw: str) -> float:
    job = fio(uri, rw)
    side = "read" if "read" in rw else "write"
    assert job[side]["io_bytes"] > 0, f"fio {rw} against {uri} moved no data"
    return float(job[side]["iops"])


# ------------------------------------------------------------------ memory


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def established(port: int) -> int:
    """Server-side TCP connections on ``port`` (IPv4 loopback)."""
    suffix = f":{port:04X}"
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1].endswith(suffix) and fields[3] == "01":
                count += 1
    return count


@dataclass
class MemorySampler:
    """Polls a server's VmRSS and connection count while a workload runs."""

    pid: int
    port: int
    interval: float = 0.05
    peak_rss_kib: int = 0
    peak_connections: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss_kib = max(self.peak_rss_kib, status_kib(self.pid, "VmRSS"))
                self.peak_connections = max(self.peak_connections, established(self.port))
            except (OSError, KeyError):
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@dataclass
class Memory:
    idle_mib: float
    peak_rss_mib: float
    hwm_mib: float
    connections: int


def measure_memory(server: Server, images: Images) -> Memory:
    """Peak memory of a fresh server while 8 clients hammer it at once."""
    pid = server.proc.pid
    idle = status_kib(pid, "VmRSS")
    with MemorySampler(pid, server.port) as sampler:
        for bs in ("4k", "256k"):
            fio(server.uri, "randrw", bs=bs, numjobs=CONNECTIONS, runtime=RSS_FIO_RUNTIME)
        many = [f"--connections={CONNECTIONS}", f"--threads={CONNECTIONS}"]
        run(["nbdcopy", *many, server.uri, "null:"], timeout=600)
        run(["nbdcopy", *many, str(images.source), server.uri], timeout=600)
    hwm = status_kib(pid, "VmHWM")
    server.check_alive()
    return Memory(idle / 1024, sampler.peak_rss_kib / 1024, hwm / 1024, sampler.peak_connections)


# ------------------------------------------------------------------ results


@dataclass
class Result:
    seq_read: float = 0.0
    seq_write: float = 0.0
    rand_read: float = 0.0
    rand_write: float = 0.0
    memory: Memory | None = None


def interleaved(servers: list[Server], rounds: int) -> Iterator[Server]:
    """Every server once per round, the order rotated each round.

    On a machine where other work comes and goes, a quiet or busy spell then
    falls on all three servers alike instead of on whichever was running.
    """
    for r in range(rounds):
        k = r % len(servers)
        yield from servers[k:] + servers[:k]


def check_server(server: Server, images: Images) -> None:
    """Untimed: what the server reads is the image, and what it is sent lands in it."""
    overwrite(images.image, images.pristine)
    check_read_back(server, images.pristine)
    run(["nbdcopy", str(images.source), server.uri], timeout=600)
    server.check_alive()
    fsync_path(images.image)
    assert same_content(images.image, images.source), (
        f"{server.name}: the image does not hold what nbdcopy wrote"
    )


def bench_all(images: Images, logs: Path, results: dict[str, Result]) -> None:
    """Fill ``results`` (one entry per server) as the measurements come in."""
    with ExitStack() as stack:
        # All three serve the same file at once; only one is driven at a time.
        servers = [stack.enter_context(serving(spec, images.image, logs)) for spec in SERVERS]
        for server in servers:
            check_server(server, images)
        for path in (images.image, images.source):
            warm(path)
        times: dict[str, list[float]] = {s.name: [] for s in servers}
        for server in interleaved(servers, SEQ_RUNS):
            times[server.name].append(timed(["nbdcopy", server.uri, "null:"]))
        for server in servers:
            results[server.name].seq_read = IMAGE_SIZE / 1e6 / min(times[server.name])
        times = {s.name: [] for s in servers}
        for server in interleaved(servers, SEQ_RUNS):
            times[server.name].append(timed(["nbdcopy", str(images.source), server.uri]))
            # Untimed: the next run must not pay for this one's writeback.
            fsync_path(images.image)
        for server in servers:
            results[server.name].seq_write = IMAGE_SIZE / 1e6 / min(times[server.name])
        for server in interleaved(servers, FIO_ROUNDS):
            r = results[server.name]
            r.rand_read = max(r.rand_read, fio_iops(server.uri, "randread"))
        for server in interleaved(servers, FIO_ROUNDS):
            r = results[server.name]
            r.rand_write = max(r.rand_write, fio_iops(server.uri, "randwrite"))
            fsync_path(images.image)
        for server in servers:
            server.check_alive()
    # Memory on a fresh process each, so that its high-water mark is the 8-client one.
    for spec in SERVERS:
        with serving(spec, images.image, logs) as server:
            results[spec.name].memory = measure_memory(server, images)
        fsync_path(images.image)


def moorage_revision() -> str:
    """The commit under test, and whether the server's code differs from it."""
    try:
        head = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False)
        dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--", "nbd", "moorage"])
    except (OSError, AssertionError):
        return "unknown revision"
    if head.returncode != 0:
        return "unknown revision"
    return head.stdout.strip() + (" + uncommitted changes in nbd/ or moorage/" * bool(dirty.stdout))


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


@dataclass(frozen=True)
class Row:
    label: str
    values: tuple[float, float, float]  # moorage, qemu-nbd, nbdkit
    target: str = ""
    met: Callable[[float, float], bool] | None = None  # (moorage, qemu-nbd) -> on target


def table(results: dict[str, Result]) -> str:
    """The figures as a markdown table, ratios and targets included."""
    m, q, k = (results.get(s.name, Result()) for s in SERVERS)
    zero = Memory(0, 0, 0, 0)
    mm, qm, km = (r.memory or zero for r in (m, q, k))
    rows = [
        Row(
            "sequential read, nbdcopy → null: (MB/s)",
            (m.seq_read, q.seq_read, k.seq_read),
            ">= 1.0x qemu-nbd",
            lambda a, b: a >= b,
        ),
        Row(
            "sequential write, nbdcopy file → NBD (MB/s)",
            (m.seq_write, q.seq_write, k.seq_write),
            ">= 1.0x qemu-nbd",
            lambda a, b: a >= b,
        ),
        Row(
            "4 KiB random read, QD32, 1 conn (IOPS)",
            (m.rand_read, q.rand_read, k.rand_read),
            ">= 0.5x qemu-nbd",
            lambda a, b: a >= 0.5 * b,
        ),
        Row(
            "4 KiB random write, QD32, 1 conn (IOPS)",
            (m.rand_write, q.rand_write, k.rand_write),
            ">= 0.5x qemu-nbd",
            lambda a, b: a >= 0.5 * b,
        ),
        Row("RSS idle (MiB)", (mm.idle_mib, qm.idle_mib, km.idle_mib)),
        Row(
            f"RSS peak sampled, {CONNECTIONS} conns (MiB)",
            (mm.peak_rss_mib, qm.peak_rss_mib, km.peak_rss_mib),
        ),
        Row(
            f"VmHWM, {CONNECTIONS} conns (MiB)",
            (mm.hwm_mib, qm.hwm_mib, km.hwm_mib),
            "moorage < 100 MiB",
            lambda a, _b: a < 100,
        ),
    ]
    lines = [
        "| metric | moorage | qemu-nbd | nbdkit | moorage/qemu-nbd | moorage/nbdkit "
        "| target | met |",
        "|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for row in rows:
        a, b, c = row.values
        met = ""
        if row.met is not None and a and b:
            met = "yes" if row.met(a, b) else "**no**"
        fmt = "{:,.0f}" if max(row.values) >= 1000 else "{:,.1f}"
        cells = " | ".join(fmt.format(v) for v in row.values)
        lines.append(
            f"| {row.label} | {cells} | {ratio(a, b)} | {ratio(a, c)} | {row.target} | {met} |"
        )
    lines.append(
        f"\nconnections seen during the memory run: moorage {mm.connections}, "
        f"qemu-nbd {qm.connections}, nbdkit {km.connections}"
    )
    return "\n".join(lines)


def test_nbd_servers(images: Images, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    results = {spec.name: Result() for spec in SERVERS}
    load_before = loadavg()
    try:
        bench_all(images, logs, results)
    finally:
        print("\n" + "=" * 100)
        print(
            f"NBD benchmark, {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, "
            f"{IMAGE_SIZE // MiB} MiB random image in page cache, loopback TCP"
        )
        for argv in (["qemu-nbd", "--version"], ["nbdkit", "--version"], ["fio", "--version"]):
            print(f"  {version(argv)}")
        print(f"  {version(['nbdcopy', '--version'], lines=2)}")
        print(f"  moorage {moorage_revision()}, Python {sys.version.split()[0]}")
        print(f"  load average before: {load_before}, after: {loadavg()}")
        print()
        print(table(results))
        print("=" * 100)
    for name, r in results.items():
        assert min(r.seq_read, r.seq_write, r.rand_read, r.rand_write) > 0, name
        assert r.memory is not None and r.memory.connections >= CONNECTIONS, (
            f"{name}: expected {CONNECTIONS} connections during the memory run, "
            f"saw {r.memory.connections if r.memory else 0}"
        )

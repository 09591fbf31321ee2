"""moorage's NBD server against qemu-nbd and nbdkit, with the same clients on the same image.

Run with ``make bench``.  One 1 GiB image of random data, kept in the page
cache, is served by all three servers at once (each on its own loopback
port); one client runs at a time, and the same client commands measure the
rows of issue 22's table:

- sequential read: ``nbdcopy nbd://... null:`` with nbdcopy's defaults (4
  connections on a server that advertises multi-conn), best of 3, MB/s
  (10^6 bytes/s);
- sequential write: ``nbdcopy SRC nbd://...`` from another 1 GiB random file,
  best of 3, MB/s;
- 4 KiB random read and write: fio's ``nbd`` engine, queue depth 32, on one
  connection and on four (``numjobs=4``: the engine opens one connection per
  job; the jobs' IOPS summed), 10 s per run, best of 2, IOPS;
- memory: a fresh server process driven over 8 connections at once (fio with
  8 jobs, small and large blocks, then nbdcopy with 8 connections both ways),
  summed over every process of the server (its process tree): the peak of
  the summed VmRSS sampled from /proc while they run and the sum of VmHWM at
  the end, with the number of processes.

The repeated runs are interleaved (moorage, qemu-nbd, nbdkit, then rotated),
so that other load on the machine falls on all three alike.  Before timing,
each server must read back the image exactly and write a whole copy exactly.
The connections the servers saw during the runs are counted and printed.

Nothing here asserts a speed: the test fails only if a run fails or the data
read back or written is wrong.  The figures are printed as a table with the
ratios moorage/qemu-nbd and moorage/nbdkit and issue 22's goals (against
nbdkit); see docs/performance.md.  ``MOORAGE_BENCH_NBD_ARGS`` adds arguments
to moorage's server (tests/bench/harness.py).

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
    NBD_ARGS_ENV,
    Server,
    ServerSpec,
    moorage_argv,
    moorage_extra_args,
    process_tree,
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
CONNECTIONS = 8  # the memory run
FIO_CONNECTIONS = (1, 4)  # the random I/O rows: fio jobs, one connection each
MEMORY_GOAL_MIB = 96  # issue 22: VmHWM summed over the server's processes
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


def fio_iops(uri: str, rw: str, numjobs: int) -> float:
    """IOPS of ``numjobs`` fio jobs (one NBD connection each), summed by group reporting."""
    job = fio(uri, rw, numjobs=numjobs)
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


def tree_kib(pid: int, key: str) -> tuple[int, int]:
    """``key`` (VmRSS, VmHWM) summed over ``pid``'s process tree, and how many processes."""
    total = count = 0
    for p in process_tree(pid):
        try:
            total += status_kib(p, key)
            count += 1
        except (OSError, KeyError):
            pass  # exited, or a zombie (no Vm* lines)
    return total, count


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
class Sampler:
    """Polls a server's connection count and, if ``rss``, its process tree's summed
    VmRSS and size while a workload runs."""

    pid: int
    port: int
    rss: bool = True
    interval: float = 0.05
    peak_rss_kib: int = 0
    peak_processes: int = 0
    peak_connections: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                if self.rss:
                    rss, processes = tree_kib(self.pid, "VmRSS")
                    self.peak_rss_kib = max(self.peak_rss_kib, rss)
                    self.peak_processes = max(self.peak_processes, processes)
                self.peak_connections = max(self.peak_connections, established(self.port))
            except OSError:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
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
    processes: int


def measure_memory(server: Server, images: Images) -> Memory:
    """Peak memory of a fresh server, all its processes summed, while 8 clients hammer it."""
    pid = server.proc.pid
    idle, _ = tree_kib(pid, "VmRSS")
    with Sampler(pid, server.port) as sampler:
        for bs in ("4k", "256k"):
            fio(server.uri, "randrw", bs=bs, numjobs=CONNECTIONS, runtime=RSS_FIO_RUNTIME)
        many = [f"--connections={CONNECTIONS}", f"--threads={CONNECTIONS}"]
        run(["nbdcopy", *many, server.uri, "null:"], timeout=600)
        run(["nbdcopy", *many, str(images.source), server.uri], timeout=600)
    hwm, processes = tree_kib(pid, "VmHWM")
    server.check_alive()
    return Memory(
        idle / 1024,
        sampler.peak_rss_kib / 1024,
        hwm / 1024,
        sampler.peak_connections,
        max(processes, sampler.peak_processes),
    )


# ------------------------------------------------------------------ results


@dataclass
class Result:
    seq_read: float = 0.0
    seq_write: float = 0.0
    # fio jobs (= connections) -> best IOPS
    rand_read: dict[int, float] = field(default_factory=dict)
    rand_write: dict[int, float] = field(default_factory=dict)
    # the most connections the server saw during a run: "seq read", "randread 4", ...
    connections: dict[str, int] = field(default_factory=dict)
    memory: Memory | None = None

    def seen(self, what: str, sampler: Sampler) -> None:
        self.connections[what] = max(self.connections.get(what, 0), sampler.peak_connections)


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


def connections_of(server: Server) -> Sampler:
    """Counts the connections ``server`` sees while a timed run goes on (no /proc/PID)."""
    return Sampler(server.proc.pid, server.port, rss=False)


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
            with connections_of(server) as sampler:
                times[server.name].append(timed(["nbdcopy", server.uri, "null:"]))
            results[server.name].seen("seq read", sampler)
        for server in servers:
            results[server.name].seq_read = IMAGE_SIZE / 1e6 / min(times[server.name])
        times = {s.name: [] for s in servers}
        for server in interleaved(servers, SEQ_RUNS):
            with connections_of(server) as sampler:
                times[server.name].append(timed(["nbdcopy", str(images.source), server.uri]))
            results[server.name].seen("seq write", sampler)
            # Untimed: the next run must not pay for this one's writeback.
            fsync_path(images.image)
        for server in servers:
            results[server.name].seq_write = IMAGE_SIZE / 1e6 / min(times[server.name])
        for rw in ("randread", "randwrite"):
            for jobs in FIO_CONNECTIONS:
                for server in interleaved(servers, FIO_ROUNDS):
                    r = results[server.name]
                    best = r.rand_read if rw == "randread" else r.rand_write
                    with connections_of(server) as sampler:
                        iops = fio_iops(server.uri, rw, jobs)
                    best[jobs] = max(best.get(jobs, 0.0), iops)
                    r.seen(f"{rw} {jobs}", sampler)
                    if rw == "randwrite":
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
    goal: str = ""  # issue 22's goal
    met: Callable[[float, float], bool] | None = None  # (moorage, nbdkit) -> goal met


def at_least(share: float) -> tuple[str, Callable[[float, float], bool]]:
    return f">= {share:.1f}x nbdkit", lambda a, k: a >= share * k


def table(results: dict[str, Result]) -> str:
    """The figures as a markdown table, ratios and issue 22's goals included."""
    m, q, k = (results.get(s.name, Result()) for s in SERVERS)
    zero = Memory(0, 0, 0, 0, 0)
    mm, qm, km = (r.memory or zero for r in (m, q, k))
    rows = [
        Row(
            "sequential read, nbdcopy → null: (multi-conn, nbdcopy defaults) (MB/s)",
            (m.seq_read, q.seq_read, k.seq_read),
            *at_least(1.0),
        ),
        Row(
            "sequential write, nbdcopy file → NBD (MB/s)",
            (m.seq_write, q.seq_write, k.seq_write),
            *at_least(1.0),
        ),
    ]
    # issue 22's goals for the random I/O rows: one connection, then four
    goals = {1: 0.8, 4: 1.0}
    for label, mr, qr, kr in (
        ("read", m.rand_read, q.rand_read, k.rand_read),
        ("write", m.rand_write, q.rand_write, k.rand_write),
    ):
        for jobs in FIO_CONNECTIONS:
            conns = "1 conn" if jobs == 1 else f"{jobs} conns (numjobs={jobs}, summed)"
            rows.append(
                Row(
                    f"4 KiB random {label}, QD32, {conns} (IOPS)",
                    (mr.get(jobs, 0.0), qr.get(jobs, 0.0), kr.get(jobs, 0.0)),
                    *at_least(goals[jobs]),
                )
            )
    rows += [
        Row("RSS idle, all processes (MiB)", (mm.idle_mib, qm.idle_mib, km.idle_mib)),
        Row(
            f"RSS peak sampled, {CONNECTIONS} conns, all processes (MiB)",
            (mm.peak_rss_mib, qm.peak_rss_mib, km.peak_rss_mib),
        ),
        Row(
            f"VmHWM, {CONNECTIONS} conns, all processes summed (MiB)",
            (mm.hwm_mib, qm.hwm_mib, km.hwm_mib),
            f"moorage <= {MEMORY_GOAL_MIB} MiB",
            lambda a, _k: a <= MEMORY_GOAL_MIB,
        ),
        Row(
            f"server processes, {CONNECTIONS} conns",
            (float(mm.processes), float(qm.processes), float(km.processes)),
        ),
    ]
    lines = [
        "| metric | moorage | qemu-nbd | nbdkit | moorage/qemu-nbd | moorage/nbdkit "
        "| goal (issue 22) | met |",
        "|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for row in rows:
        a, b, c = row.values
        met = ""
        if row.met is not None and a and c:
            met = "yes" if row.met(a, c) else "**no**"
        fmt = "{:,.0f}" if max(row.values) >= 1000 else "{:,.1f}"
        if row.label.startswith("server processes"):
            fmt = "{:.0f}"
        cells = " | ".join(fmt.format(v) for v in row.values)
        ratios = f"{ratio(a, b)} | {ratio(a, c)}"
        if row.label.startswith(("RSS", "server processes")):
            ratios = " | "
        lines.append(f"| {row.label} | {cells} | {ratios} | {row.goal} | {met} |")
    lines.append("\nconnections each server saw (most at once):")
    for name, r in results.items():
        memory = r.memory.connections if r.memory else 0
        seen = ", ".join(f"{what} {n}" for what, n in r.connections.items())
        lines.append(f"  {name}: {seen}, memory run {memory}")
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
        extra = " ".join(moorage_extra_args()) or "(none)"
        print(f"  moorage nbd serve's extra arguments ({NBD_ARGS_ENV}): {extra}")
        print(f"  load average before: {load_before}, after: {loadavg()}")
        print()
        print(table(results))
        print("=" * 100)
    for name, r in results.items():
        assert min(r.seq_read, r.seq_write) > 0, name
        for jobs in FIO_CONNECTIONS:
            assert min(r.rand_read.get(jobs, 0), r.rand_write.get(jobs, 0)) > 0, (name, jobs)
            for rw in ("randread", "randwrite"):
                seen = r.connections.get(f"{rw} {jobs}", 0)
                assert seen >= jobs, f"{name}: {rw} with {jobs} fio jobs used {seen} connections"
        assert r.memory is not None and r.memory.connections >= CONNECTIONS, (
            f"{name}: expected {CONNECTIONS} connections during the memory run, "
            f"saw {r.memory.connections if r.memory else 0}"
        )

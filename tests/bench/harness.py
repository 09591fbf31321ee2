"""The benchmarks' harness: an NBD server process on a free loopback port, stopped
however the run ends with every process it started (its log's tail printed if it
failed), the process tree of a server, and the figures of a report: nearest-rank
percentiles, ratios, tool versions.

``MOORAGE_BENCH_NBD_ARGS`` adds arguments to moorage's ``nbd serve`` command line
(split as a shell would, e.g. ``--workers 2``), so that a build with other settings
is measured without editing the benchmarks."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, free_port, run, wait_for_port

EXPORT = "bench"
NBD_ARGS_ENV = "MOORAGE_BENCH_NBD_ARGS"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: Callable[[int, Path], list[str]]


def moorage_extra_args() -> list[str]:
    """The extra ``nbd serve`` arguments of ``MOORAGE_BENCH_NBD_ARGS`` (none by default)."""
    return shlex.split(os.environ.get(NBD_ARGS_ENV, ""))


def moorage_argv(port: int, image: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moorage",
        "nbd",
        "serve",
        "--export",
        f"{EXPORT}={image}",
        "--listen",
        f"127.0.0.1:{port}",
        *moorage_extra_args(),
    ]


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants still alive (each thread's children, recursively)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue  # gone meanwhile
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return tree


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def uri(self) -> str:
        return f"nbd://127.0.0.1:{self.port}/{EXPORT}"

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.proc.returncode}:\n{log_tail(self.log)}"
            )


def log_tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` s; descendants the server left behind
    (worker processes) are killed after it has gone."""
    children = [(p, _start_time(p)) for p in process_tree(proc.pid)[1:]]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid, started in children:
        if started is not None and _start_time(pid) == started:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def serving(spec: ServerSpec, image: Path, logs: Path) -> Iterator[Server]:
    """One server process on a free loopback port; stopped however the block ends."""
    port = free_port()
    log = logs / f"{spec.name}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            spec.argv(port, image), stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        )
    try:
        wait_for_port(port, proc)
        server = Server(spec.name, port, proc, log)
        yield server
        server.check_alive()
    except BaseException:
        print(f"\n--- {spec.name} log (last lines) ---\n{log_tail(log)}")
        raise
    finally:
        stop(proc)


def version(argv: list[str], lines: int = 1) -> str:
    out = run(argv, check=False)
    return ", ".join((out.stdout or out.stderr).strip().splitlines()[:lines])


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]

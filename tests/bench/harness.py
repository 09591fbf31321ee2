"""The benchmarks' harness: an NBD server process on a free loopback port, stopped
however the run ends (its log's tail printed if it failed), an image fsynced between
runs, and the figures of a report: nearest-rank percentiles, ratios, tool versions."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, free_port, run, wait_for_port

EXPORT = "bench"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: Callable[[int, Path], list[str]]


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
    ]


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
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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

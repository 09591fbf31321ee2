"""Shared fixtures: real NBD server processes, sparse images, free ports; the order's seed
printed at the end of a run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """The seed of the run's order at its end, where ``-q`` still shows it: pytest-randomly
    shuffles the tests (and prints its seed only in the header, which ``-q`` hides)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and getattr(config.option, "randomly_reorganize", False):
        terminalreporter.write_line(
            f"random test order, seed {seed}: --randomly-seed={seed} runs the same tests in "
            f"the same order again (make unit PYTEST_ARGS=--randomly-seed={seed})"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 20
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; the exit status (0: never started)."""
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else 0
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def go_module_dir(module_at_version: str) -> Path:
    """Where Go's module cache holds MODULE@VERSION (downloaded if missing)."""
    import json
    import shutil

    go = os.environ.get("MOORAGE_GO") or shutil.which("go") or "/usr/local/go/bin/go"
    result = subprocess.run(
        [go, "mod", "download", "-json", module_at_version],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Path(json.loads(result.stdout)["Dir"])


def sparse_image(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.truncate(size)
    return path


@dataclass
class NBDServerProcess:
    """A ``moorage nbd serve`` process on a free loopback port."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)

    def uri(self, export: str, scheme: str = "nbd") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/{export}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> list[int]:
        """The listener and every process under it (its worker processes)."""
        found: list[int] = []
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in task.read_text().split()]
        return found

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the listener and its workers: SIGSTOP stops the whole server,
        whichever process serves a connection."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


# Worker processes of a test server unless a test says otherwise: the NBD
# tests run against the multi-process server (listener + one worker), and the
# single-process one where a test asks for ``workers=1``.
TEST_WORKERS = 2


class NBDServerFactory:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers: list[NBDServerProcess] = []

    def start(
        self,
        exports: dict[str, Path | str],
        *args: str,
        port: int | None = None,
        workers: int = TEST_WORKERS,
    ) -> NBDServerProcess:
        """Start a server; an export value may end in ':ro'.  Extra CLI args after."""
        port = port or free_port()
        argv = [
            sys.executable,
            "-m",
            "moorage",
            "-v",
            "nbd",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
        ]
        for name, path in exports.items():
            argv += ["--export", f"{name}={path}"]
        argv += list(args)
        if "--workers" not in args:
            argv += ["--workers", str(workers)]
        log = self.tmp / f"nbd-server-{port}-{len(self.servers)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        server = NBDServerProcess(port=port, proc=proc, log=log, argv=argv)
        self.servers.append(server)
        wait_for_port(port, proc)
        return server

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop(signal.SIGKILL if os.environ.get("MOORAGE_TEST_FAST_KILL") else signal.SIGTERM)


@pytest.fixture
def nbd_servers(tmp_path: Path) -> Iterator[NBDServerFactory]:
    factory = NBDServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


def run(
    argv: list[str], timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a client tool; on failure the error carries its stderr."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{argv} exited {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result

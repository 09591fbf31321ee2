"""Network namespaces for tests: ``ip`` itself, what runs in a namespace, killing it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def netns_pids(ns: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in result.stdout.split()]


def _describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        cmdline = "?"
    return f"{pid} {cmdline.strip()}"


def kill_netns_processes(ns: str, timeout: float = 10.0) -> list[str]:
    """SIGKILL every process in ``ns`` and wait for them to go; returns what was killed."""
    killed = [_describe(pid) for pid in netns_pids(ns)]
    deadline = time.monotonic() + timeout
    while pids := netns_pids(ns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {ns} survive SIGKILL: {pids}")
        time.sleep(0.05)
    return killed


def netns_list() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]

"""The real NBD clients the tests drive: qemu-io (its ``nbd_send_request`` trace
parsed into the requests the server got, and an interactive session that keeps one
connection across commands) and nbdinfo; and readers of an image's bytes, checksum
and allocation map (SEEK_DATA/SEEK_HOLE), to check what the clients did."""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import run

MiB = 1 << 20
TIMEOUT = 60

# NBD command types and flags as qemu's trace prints them.
READ, WRITE, FLUSH, TRIM, WRITE_ZEROES = 0, 1, 3, 4, 6
FUA, NO_HOLE, FAST_ZERO = 0x1, 0x2, 0x10


@dataclass(frozen=True)
class Sent:
    """One request qemu sent to the server (from its nbd_send_request trace)."""

    type: int
    offset: int
    length: int
    flags: int


_TRACE = re.compile(
    r"nbd_send_request .*?\.from = (\d+), \.len = (\d+), \.handle = \d+, "
    r"\.flags = (0x[0-9a-fA-F]+), \.type = (\d+)"
)


def sent_requests(trace: str) -> list[Sent]:
    return [
        Sent(type=int(t), offset=int(o), length=int(n), flags=int(f, 16))
        for o, n, f, t in _TRACE.findall(trace)
    ]


def nbd_target(uri: str) -> list[str]:
    """qemu-io arguments that open ``uri`` as a raw NBD image."""
    return ["-f", "raw", uri]


def qemu_io(
    target: Sequence[str], *commands: str, extra: Sequence[str] = (), check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run qemu-io commands (writeback cache: FUA only where asked for) with request tracing.

    qemu-io exits non-zero when any command fails, a pattern mismatch included.
    """
    argv = ["qemu-io", "-t", "writeback", "-T", "nbd_send_request", *extra]
    for c in commands:
        argv += ["-c", c]
    result = run([*argv, *target], timeout=TIMEOUT, check=check)
    if check:
        assert "failed" not in result.stdout, result.stdout
    return result


_PROMPT = b"qemu-io> "


class QemuIOSession:
    """An interactive qemu-io: one NBD connection kept open across commands."""

    def __init__(self, uri: str, trace_file: Path) -> None:
        self.trace_file = trace_file
        self._stderr = trace_file.open("wb")
        self.proc = subprocess.Popen(
            ["qemu-io", "-t", "writeback", "-T", "nbd_send_request", "-f", "raw", uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        # qemu-io prints its prompt when ready for the next command.
        self._until_prompt("(open)")

    def _until_prompt(self, command: str) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        deadline = time.monotonic() + TIMEOUT
        while not out.endswith(_PROMPT):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"qemu-io did not finish {command!r}: {out!r}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"qemu-io exited during {command!r}: {out!r}")
                out += chunk
        return out[: -len(_PROMPT)].decode(errors="replace")

    def cmd(self, command: str) -> str:
        """Run one command; fails if qemu-io reports an error or a pattern mismatch."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n".encode())
        self.proc.stdin.flush()
        out = self._until_prompt(command)
        assert "failed" not in out, f"{command!r}: {out}"
        return out

    def trace(self) -> list[Sent]:
        self._stderr.flush()
        return sent_requests(self.trace_file.read_text(errors="replace"))

    def close(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return self.proc.returncode


def read_range(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)


def fill(path: Path, offset: int, data: bytes) -> None:
    """Write into an image in place (dd conv=notrunc) and make it durable."""
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def allocation_map(path: Path) -> list[tuple[int, int, bool]]:
    """(offset, length, is_hole) runs of a file, from SEEK_DATA/SEEK_HOLE."""
    size = path.stat().st_size
    runs: list[tuple[int, int, bool]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                runs.append((pos, size - pos, True))
                break
            if data > pos:
                runs.append((pos, data - pos, True))
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            runs.append((data, hole - data, False))
            pos = hole
    finally:
        os.close(fd)
    return runs


def is_hole(path: Path, offset: int, length: int) -> bool:
    """True if no byte of the range is allocated as data."""
    end = offset + length
    return all(not (o < end and offset < o + n) for o, n, hole in allocation_map(path) if not hole)


def allocated_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def nbdinfo_json(uri: str, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(run(["nbdinfo", "--json", *args, uri], timeout=TIMEOUT).stdout)
    return out


def connections_served(log: str, export: str) -> int:
    return len(re.findall(rf": serving export {re.escape(export)} \(", log))

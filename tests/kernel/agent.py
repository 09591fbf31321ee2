"""The kernel lane's guest agent: runs what the host's tests ask, inside the guest.

Started by the guest's /init (deploy/kernel-lane/init) from the tree under
test; it talks to the host over the virtio-serial port named
``moorage.agent``, one JSON object per line each way, one request at a time:

- ``{"op": "run", "argv": [...], "timeout": S, "input": TEXT}`` runs a
  command to its end (killed past ``timeout``) and answers ``rc``, ``stdout``,
  ``stderr`` (``rc`` is null when it timed out);
- ``{"op": "spawn", "name": N, "argv": [...], "log": PATH}`` starts a
  long-running process (its output to ``log``) and answers its ``pid``;
- ``{"op": "signal", "name": N, "signal": SIG}`` signals it; ``{"op": "wait",
  "name": N, "timeout": S}`` waits for its end and answers ``rc``;
- ``{"op": "poweroff"}`` answers, then the agent exits and /init powers off.

Standard library only: it is the first thing the guest runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

PORT_NAME = "moorage.agent"
VIRTIO_PORTS = Path("/sys/class/virtio-ports")


def _port() -> Path:
    for entry in sorted(VIRTIO_PORTS.iterdir()):
        if (entry / "name").read_text().strip() == PORT_NAME:
            return Path("/dev") / entry.name
    raise SystemExit(f"agent: no virtio port named {PORT_NAME}")


class Agent:
    def __init__(self) -> None:
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            done = subprocess.run(
                req["argv"],
                input=req.get("input"),
                capture_output=True,
                text=True,
                timeout=req.get("timeout", 120),
                cwd=req.get("cwd"),
                env={**os.environ, **req.get("env", {})},
            )
        except subprocess.TimeoutExpired as e:
            return {"rc": None, "stdout": _text(e.stdout), "stderr": _text(e.stderr)}
        except OSError as e:
            return {"rc": 127, "stdout": "", "stderr": f"{req['argv'][0]}: {e}"}
        return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}

    def spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req["name"]
        old = self.processes.get(name)
        if old is not None and old.poll() is None:
            return {"error": f"{name} is still running (pid {old.pid})"}
        with open(req["log"], "ab") as log:
            process = subprocess.Popen(
                req["argv"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=req.get("cwd"),
                env={**os.environ, **req.get("env", {})},
                start_new_session=True,
            )
        self.processes[name] = process
        return {"pid": process.pid}

    def signal(self, req: dict[str, Any]) -> dict[str, Any]:
        process = self.processes[req["name"]]
        if process.poll() is None:
            os.kill(process.pid, signal.Signals[req["signal"]])
        return {"rc": process.poll()}

    def wait(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"rc": self.processes[req["name"]].wait(req.get("timeout", 60))}
        except subprocess.TimeoutExpired:
            return {"rc": None}

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op not in ("run", "spawn", "signal", "wait"):
            return {"error": f"unknown op {op!r}"}
        try:
            result: dict[str, Any] = getattr(self, op)(req)
            return result
        except (KeyError, OSError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"}


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def main() -> None:
    agent = Agent()
    with open(_port(), "r+b", buffering=0) as port:
        reader = os.fdopen(os.dup(port.fileno()), "rb")
        port.write(b'{"hello": "' + os.uname().release.encode() + b'"}\n')
        for line in reader:
            req = json.loads(line)
            if req.get("op") == "poweroff":
                port.write(b'{"bye": true}\n')
                break
            port.write(json.dumps(agent.answer(req)).encode() + b"\n")
    for process in agent.processes.values():
        if process.poll() is None:
            process.kill()
    sys.exit(0)


if __name__ == "__main__":
    main()

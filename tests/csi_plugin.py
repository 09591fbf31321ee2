"""A real ``moorage csi serve`` process for tests, a gRPC client of its socket,
and kubelet's paths under a test's directory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.conftest import REPO, stop_process

DRIVER = "csi.moorage.dev"
# what `moorage csi serve` logs once every listener it was asked for is up
STARTED = b"csi plugin in "


def write_config(path: Path, storage_nodes: Sequence[Mapping[str, object]], node: str = "") -> Path:
    """A TOML configuration: each storage node as a dict (topology a nested dict)."""
    lines: list[str] = []
    for sn in storage_nodes:
        lines.append("[[storage_nodes]]")
        for key, value in sn.items():
            if key != "topology":
                lines.append(f"{key} = {_toml(value)}")
        topology = sn.get("topology") or {}
        assert isinstance(topology, Mapping)
        if topology:
            lines.append("[storage_nodes.topology]")
            lines += [f'"{k}" = {_toml(v)}' for k, v in topology.items()]
    path.write_text("\n".join(lines) + "\n" + node)
    return path


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


@dataclass
class Kubelet:
    """kubelet's paths under ``root`` (its --root-dir)."""

    root: Path

    def global_mount(self, handle: str) -> Path:
        digest = hashlib.sha256(handle.encode()).hexdigest()
        return self.root / "plugins/kubernetes.io/csi" / DRIVER / digest / "globalmount"

    def pod_target(self, pod: str, pv: str) -> Path:
        return self.root / "pods" / pod / "volumes/kubernetes.io~csi" / pv / "mount"

    def block_staging(self, pv: str) -> Path:
        return self.root / "plugins/kubernetes.io/csi/volumeDevices/staging" / pv

    def block_target(self, pod: str, pv: str) -> Path:
        return self.root / "plugins/kubernetes.io/csi/volumeDevices/publish" / pv / pod


@dataclass
class CsiPlugin:
    root: Path
    mode: str = "controller"
    config: Path | None = None
    node_id: str = "node-a"
    node_address: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    # the test host's root mount may be private, and the plugin's mounts are used
    # in this mount namespace: the propagation check has tests of its own
    allow_private_mounts: bool = True
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / f"csi-{self.mode}.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log(self) -> Path:
        return self.root / f"csi-{self.mode}.log"

    def argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "moorage", "-v", "csi", "serve",
            "--endpoint", self.endpoint, "--mode", self.mode,
        ]  # fmt: skip
        if self.config is not None:
            argv += ["--config", str(self.config)]
        if self.mode != "controller":
            # node mode keeps its state in the test's directory unless told otherwise
            if "--state-dir" not in self.extra_args:
                argv += ["--state-dir", str(self.root / f"state-{self.mode}")]
            # and takes kubelet's paths under it (ROOT/kubelet) unless told otherwise
            if "--kubelet-dir" not in self.extra_args:
                argv += ["--kubelet-dir", str(self.root / "kubelet")]
            argv += ["--node-id", self.node_id, "--node-address", self.node_address]
            if self.allow_private_mounts:
                argv.append("--allow-private-mounts")
        return argv + self.extra_args

    def start(self, timeout: float = 30) -> CsiPlugin:
        self.root.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            # the log is kept across restarts: this run's lines start here
            logged_before = out.tell()
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ)
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"plugin exited {self.proc.returncode}:\n{self.log_text()}")
            # the gRPC socket answers before the plugin's other listeners (healthz,
            # registration) are up; the plugin logs STARTED once all of them are
            if self.started_since(logged_before) and self.socket.exists() and self.answers():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"plugin not serving after {timeout}s:\n{self.log_text()}")

    def started_since(self, offset: int) -> bool:
        """True once this run of the plugin has logged that everything it serves is up."""
        try:
            with self.log.open("rb") as f:
                f.seek(offset)
                return STARTED in f.read()
        except OSError:
            return False

    def answers(self) -> bool:
        """True once the plugin answers GetPluginInfo on its socket."""
        with grpc.insecure_channel(self.endpoint) as ch:
            try:
                stub = pb_grpc.IdentityStub(ch)  # type: ignore[no-untyped-call]
                stub.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return True

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.endpoint)

    def stop(self, timeout: float = 20) -> int:
        return stop_process(self.proc, timeout)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"


def sanity_binary() -> Path:
    path = os.environ.get("MOORAGE_CSI_SANITY")
    assert path, "MOORAGE_CSI_SANITY is not set: run the tests through make (make test)"
    assert os.access(path, os.X_OK), f"{path} is missing: make tools builds it"
    return Path(path)

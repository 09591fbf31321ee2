"""A real storage-node daemon for tests: a loop pool, free ports, a process.

``BackendNode`` starts ``moorage backend serve`` as a child process on a loop
pool made for the test, can kill it (SIGKILL, with failpoints armed through
MOORAGE_FAILPOINTS) and restart it on the same state, and tears everything
down: daemon, ganesha, mounts, loop devices.

With ``netns`` set the daemon runs inside that network namespace (``ip netns
exec``) with a ``/run`` of its own, as in a container: rpcbind keeps its lock
and socket there, so with the host's ``/run`` the node's rpcbind would abort
("another rpcbind is already running") when the host runs one, and ganesha
would register with the host's rpcbind through its socket.  Processes left in
the namespace are the caller's to stop (``ip netns pids``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from backend.api.client import BackendClient
from backend.poolinit import init_loop_pool, release_loop_pool
from tests.conftest import REPO, free_port, stop_process

POOL_SIZE = 4 << 30
# ``ip netns exec`` gives the command a mount namespace of its own (a slave of
# the host's): a tmpfs mounted on /run there is seen by the daemon and its
# children only.
_PRIVATE_RUN = 'mount -t tmpfs -o mode=0755,size=16m moorage-run /run && exec "$@"'


@dataclass
class BackendNode:
    root: Path
    nfs_port: int = field(default_factory=free_port)
    mount_port: int = field(default_factory=free_port)
    nbd_port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    # The network namespace to run in (None: the test's own), the address the
    # NBD server listens on, and the NFS server address clients are given.
    netns: str | None = None
    nbd_host: str = "127.0.0.1"
    nfs_advertise: str | None = None
    # The API on TCP (HOST:PORT) instead of the unix socket, and its bearer token.
    listen: str | None = None
    token_file: Path | None = None
    # The API also on TCP (HOST:PORT) beside the unix socket (``address`` stays the socket).
    also_listen: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def pool_dir(self) -> Path:
        return self.root / "pool"

    @property
    def socket(self) -> Path:
        return self.data_dir / "backend.sock"

    @property
    def address(self) -> str:
        return self.listen or f"unix:{self.socket}"

    @property
    def log(self) -> Path:
        return self.root / "daemon.log"

    def argv(self) -> list[str]:
        prefix: list[str] = []
        if self.netns is not None:
            prefix = ["ip", "netns", "exec", self.netns, "sh", "-c", _PRIVATE_RUN, "moorage-netns"]
        advertise = ["--nfs-advertise", self.nfs_advertise] if self.nfs_advertise else []
        return [
            *prefix,
            sys.executable,
            "-m",
            "moorage",
            "-v",
            "backend",
            "serve",
            "--data-dir",
            str(self.data_dir),
            "--pool",
            str(self.pool_dir),
            "--nfs-port",
            str(self.nfs_port),
            "--mount-port",
            str(self.mount_port),
            "--nbd-listen",
            f"{self.nbd_host}:{self.nbd_port}",
            "--graceless",
            "--grace-period",
            "5",
            "--lease-lifetime",
            "5",
            *advertise,
            *(["--listen", self.listen] if self.listen else []),
            *self._also_listen(),
            *(["--token-file", str(self.token_file)] if self.token_file else []),
            *self.extra_args,
        ]

    def _also_listen(self) -> list[str]:
        if self.also_listen is None:
            return []
        return ["--listen", f"unix:{self.socket}", "--listen", self.also_listen]

    def start(self, failpoints: Sequence[str] = (), timeout: float = 90) -> None:
        assert self.proc is None or self.proc.poll() is not None, "daemon already running"
        env = dict(os.environ)
        env.pop("MOORAGE_FAILPOINTS", None)
        if failpoints:
            env["MOORAGE_FAILPOINTS"] = ",".join(failpoints)
        self.socket.unlink(missing_ok=True)
        with self.log.open("ab") as out:
            out.write(f"\n==== start {self.starts} failpoints={list(failpoints)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )
        self.starts += 1
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.listen or self.socket.exists():
                try:
                    with self.client(timeout=5) as c:
                        if c.health().ganesha_running:
                            return
                except grpc.RpcError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"daemon not ready after {timeout}s:\n{self.log_tail()}")

    def client(self, timeout: float = 300) -> BackendClient:
        return BackendClient(self.address, token_file=self.token_file, timeout=timeout)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``moorage`` against this node."""
        env = dict(os.environ, MOORAGE_BACKEND=self.address, COLUMNS="200")
        result = subprocess.run(
            [sys.executable, "-m", "moorage", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"moorage {args} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def stop(self, timeout: float = 60) -> int:
        """Graceful stop (SIGTERM); returns the exit status."""
        return stop_process(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would (ganesha is left for the next start to stop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait_exit(self, timeout: float = 120) -> int:
        """Wait for the daemon to die by itself (a failpoint)."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def nfs_url(self, export_path: str, file: str = "", version: int = 3) -> str:
        path = export_path.rstrip("/") + (f"/{file}" if file else "")
        host = self.nfs_advertise or "127.0.0.1"
        if version == 3:
            return (
                f"nfs://{host}{path}?nfsport={self.nfs_port}&mountport={self.mount_port}&version=3"
            )
        return f"nfs://{host}{path}?nfsport={self.nfs_port}&version=4"

    def teardown(self) -> None:
        self.stop()
        _stop_orphan_ganesha(self.data_dir / "ganesha" / "ganesha.pid")
        _stop_orphan_ganesha(self.data_dir / "ganesha" / "rpcbind.pid")
        if self.pool_dir.exists():
            release_loop_pool(self.pool_dir)


def _stop_orphan_ganesha(pid_file: Path) -> None:
    """A daemon killed and never restarted leaves its ganesha (and rpcbind) behind."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        return
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def make_node(
    root: Path, extra_args: Sequence[str] = (), pool_size: int = POOL_SIZE
) -> BackendNode:
    root.mkdir(parents=True, exist_ok=True)
    init_loop_pool(root / "pool", pool_size)
    return BackendNode(root=root, extra_args=list(extra_args))


@pytest.fixture
def backend_node(tmp_path: Path) -> Iterator[BackendNode]:
    """A running storage node on a 4 GiB loop pool of its own."""
    node = make_node(tmp_path / "node")
    try:
        node.start()
        yield node
    finally:
        node.teardown()


# A storage node the tests do not run themselves (the kernel lane's guest runs the
# CSI node tests against the host's): its API address, the token file to reach it
# with, and the address it sees this machine as.
REMOTE_NODE_ENV = "MOORAGE_TEST_STORAGE_NODE"
REMOTE_TOKEN_ENV = "MOORAGE_TEST_STORAGE_TOKEN"
NODE_ADDRESS_ENV = "MOORAGE_TEST_NODE_ADDRESS"


@dataclass
class RemoteNode:
    """A running storage node elsewhere, reached over its TCP API with a token."""

    address: str
    token_file: Path

    def client(self, timeout: float = 300) -> BackendClient:
        return BackendClient(self.address, token_file=self.token_file, timeout=timeout)


def this_node_address() -> str:
    """The address storage nodes see this machine (the plugin's node) as."""
    return os.environ.get(NODE_ADDRESS_ENV, "127.0.0.1")


@contextlib.contextmanager
def storage_node(root: Path) -> Iterator[BackendNode | RemoteNode]:
    """The storage node a CSI test runs against: the one ``MOORAGE_TEST_STORAGE_NODE``
    names (with ``MOORAGE_TEST_STORAGE_TOKEN``), else a new one on a loop pool under
    ``root``, torn down after."""
    remote = os.environ.get(REMOTE_NODE_ENV)
    if remote:
        token = os.environ.get(REMOTE_TOKEN_ENV)
        assert token, f"{REMOTE_NODE_ENV} is set without {REMOTE_TOKEN_ENV}"
        yield RemoteNode(remote, Path(token))
        return
    node = make_node(root)
    try:
        node.start()
        yield node
    finally:
        node.teardown()


def plugin_entry(node: BackendNode | RemoteNode, name: str, **more: object) -> dict[str, object]:
    """The node's ``[[storage_nodes]]`` entry of a plugin configuration."""
    entry: dict[str, object] = {"name": name, "address": node.address, **more}
    if node.token_file is not None:
        entry["token_file"] = str(node.token_file)
    return entry

"""The kernel lane's host side: a network namespace, a QEMU guest in it, its agent.

``Lane`` makes, for one pytest session:

- a network namespace ``mkl-PID`` holding a tap device ``tap0`` with
  ``HOST_IP``/24, and nothing else: no link to the host's namespace, no route
  out of the subnet.  The storage node the tests start listens there, and the
  guest's only interface is the other end of that tap, so the guest reaches
  that storage node and nothing beyond it;
- the guest's initramfs: the cached root filesystem (MOORAGE_GUEST, made by
  deploy/kernel-lane/build-guest.sh) followed by an archive of the tree under
  test at its own absolute path (its code and .venv, without what only the
  host's checks use), so the agent and ``moorage`` run in the guest from the
  very files the host runs;
- QEMU (TCG: this host's nested KVM makes no progress) running in that
  namespace, its console to ``console.log``, its agent port to a unix socket
  this process listens on.

Every wait is bounded: the boot, each request to the agent (its own timeout
plus a margin), the power-off.  ``close`` kills QEMU if it will not stop,
every process left in the namespace, and the namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from tests.netns import ip, kill_netns_processes, netns_list

HOST_IP = "10.252.0.1"
GUEST_IP = "10.252.0.2"
PREFIX = 24
GUEST_MEMORY_MIB = 3072
BOOT_TIMEOUT = 180.0
API_PORT = 7443  # the storage node's API on the lane's network, beside its unix socket
MARGIN = 30.0  # what a request may take beyond the command's own timeout

# What the guest never runs: the host's checks and build tools, caches.
_SKIP_DIRS = {".git", "build", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis",
              "__pycache__", ".moorage"}  # fmt: skip
_SKIP_SITE_PACKAGES = ("mypy", "mypyc", "kubernetes_validate", "grpc_tools", "pip",
                       "psycopg_binary", "ruff", "deptry")  # fmt: skip


class GuestError(AssertionError):
    """The guest or its agent did not do what was asked."""


@dataclass
class Result:
    argv: list[str]
    rc: int | None
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"{self.argv} exited {self.rc}\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-3000:]}")  # fmt: skip


# Of the interpreter the tree's .venv was made from (when it is not Debian's):
# what running code never needs.
_SKIP_BASE = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "include",
              "share", "__pycache__"}  # fmt: skip


def _skip(path: Path) -> bool:
    parts = path.parts
    if any(p in _SKIP_DIRS for p in parts):
        return True
    if "site-packages" in parts:
        top = parts[parts.index("site-packages") + 1 :][:1]
        skipped = _SKIP_SITE_PACKAGES
        if top and any(top[0] == s or top[0].startswith((f"{s}-", f"{s}.")) for s in skipped):
            return True
        if top and top[0].endswith("__mypyc.cpython-311-x86_64-linux-gnu.so"):
            return True
    return False


def _skip_base(path: Path) -> bool:
    return path.name in _SKIP_BASE or path.name.startswith("config-")


def _walk(root: Path, skip: Callable[[Path], bool]) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not skip(here / d))
        for name in [*dirnames, *sorted(filenames)]:
            if not skip(here / name):
                yield str((here / name).relative_to("/"))


def interpreter_home() -> Path | None:
    """The installation the tree's .venv runs on, when the guest lacks it (not
    Debian's /usr: a pyenv or /opt build)."""
    base = Path(sys.base_prefix)
    return None if base == Path("/usr") else base


def tree_archive(out: Path, tree: Path = REPO, extra: Sequence[Path] = ()) -> None:
    """A newc archive of ``tree``, the .venv's interpreter and the ``extra`` files
    (tools the tests run in the guest: csi-sanity), at their absolute paths,
    parents first."""
    roots: list[tuple[Path, Callable[[Path], bool]]] = [(tree, _skip)]
    home = interpreter_home()
    if home is not None:
        roots.append((home, _skip_base))
    roots += [(path, lambda _: False) for path in extra]
    names: list[str] = []
    seen: set[str] = set()
    for root, skip in roots:
        parent = Path("/")
        for part in root.parts[1:]:
            parent = parent / part
            name = str(parent.relative_to("/"))
            if name not in seen:
                seen.add(name)
                names.append(name)
        names.extend(_walk(root, skip))
    listing = "\n".join(names) + "\n"
    with out.open("wb") as f:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], input=listing.encode(), stdout=f,
                       cwd="/", check=True, timeout=600)  # fmt: skip


class Lane:
    """The namespace, the guest and its agent (see the module docstring)."""

    def __init__(self, guest_dir: Path, work: Path, extra: Sequence[Path] = ()) -> None:
        self.guest_dir = guest_dir
        self.work = work
        self.extra = list(extra)
        self.netns = f"mkl-{os.getpid()}"
        self.console = work / "console.log"
        self.qemu: subprocess.Popen[bytes] | None = None
        self._conn: socket.socket | None = None
        self._reader: Any = None
        self.kernel_release = ""

    # -- set-up

    def create_network(self) -> None:
        ip("netns", "add", self.netns)
        ip("-n", self.netns, "link", "set", "lo", "up")
        ip("-n", self.netns, "tuntap", "add", "dev", "tap0", "mode", "tap")
        ip("-n", self.netns, "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", "tap0")
        ip("-n", self.netns, "link", "set", "tap0", "up")

    def _initrd(self) -> Path:
        """The cached root filesystem followed by the tree under test."""
        initrd = self.work / "initrd.cpio"
        tree = self.work / "tree.cpio"
        tree_archive(tree, extra=self.extra)
        with initrd.open("wb") as out:
            for part in (self.guest_dir / "base.cpio", tree):
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        tree.unlink()
        return initrd

    def _qemu_argv(self, initrd: Path, tree: str, serial: str) -> list[str]:
        cmdline = (f"console=ttyS0 panic=-1 rdinit=/init moorage.ip={GUEST_IP}/{PREFIX} "
                   f"moorage.tree={tree} moorage.hostname=kernel-lane")  # fmt: skip
        return [
            "ip", "netns", "exec", self.netns,
            "qemu-system-x86_64", "-machine", "q35,accel=tcg", "-cpu", "max",
            "-smp", "2", "-m", str(GUEST_MEMORY_MIB), "-nographic", "-no-reboot",
            "-kernel", str(self.guest_dir / "vmlinuz"), "-initrd", str(initrd),
            "-append", cmdline,
            "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no",
            "-device", "virtio-net-pci,netdev=n0",
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=agent,path={self.work / 'agent.sock'}",
            "-device", "virtserialport,chardev=agent,name=moorage.agent",
            "-serial", serial, "-monitor", "none",
        ]  # fmt: skip

    def boot(self) -> None:
        """Boot the guest and wait for its agent's hello."""
        initrd = self._initrd()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.work / "agent.sock"))
        listener.listen(1)
        listener.settimeout(BOOT_TIMEOUT)
        argv = self._qemu_argv(initrd, str(REPO), f"file:{self.console}")
        with (self.work / "qemu.log").open("wb") as log:
            self.qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)  # fmt: skip
        try:
            self._conn, _ = listener.accept()
        except TimeoutError as e:
            raise GuestError(f"QEMU did not connect the agent port:\n{self.console_tail()}") from e
        finally:
            listener.close()
        self._reader = self._conn.makefile("rb")
        hello = self._read(BOOT_TIMEOUT)
        if "hello" not in hello:
            raise GuestError(f"the agent said {hello!r}:\n{self.console_tail()}")
        self.kernel_release = str(hello["hello"])
        initrd.unlink()

    def shell(self) -> int:
        """Boot the guest with a shell on this terminal (no agent); its exit powers off."""
        initrd = self._initrd()
        # the agent port's socket: QEMU connects to it, nothing talks on it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.work / "agent.sock"))
        listener.listen(1)
        try:
            return subprocess.run(self._qemu_argv(initrd, "shell", "mon:stdio")).returncode
        finally:
            listener.close()

    # -- the agent

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self._conn is not None
        self._conn.settimeout(timeout)
        try:
            line = self._reader.readline()
        except TimeoutError as e:
            raise GuestError(
                f"no answer from the guest in {timeout:.0f}s:\n{self.console_tail()}"
            ) from e
        if not line:
            raise GuestError(f"the guest's agent went away:\n{self.console_tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def request(self, budget: float, **req: Any) -> dict[str, Any]:
        """Send one request; its answer is awaited ``budget`` seconds plus a margin."""
        assert self._conn is not None, "the guest is not running"
        self._conn.sendall(json.dumps(req).encode() + b"\n")
        answer = self._read(budget + MARGIN)
        if "error" in answer:
            raise GuestError(f"{req.get('op')}: {answer['error']}")
        return answer

    def run(self, *argv: str, timeout: float = 120, check: bool = True, input: str | None = None,
            env: dict[str, str] | None = None) -> Result:  # fmt: skip
        """Run ``argv`` in the guest to its end."""
        answer = self.request(timeout, op="run", argv=list(argv), timeout=timeout, input=input,
                              env=env or {}, cwd=str(REPO))  # fmt: skip
        result = Result(list(argv), answer["rc"], answer["stdout"], answer["stderr"])
        if check and result.rc != 0:
            raise GuestError(str(result))
        return result

    def sh(self, script: str, timeout: float = 120, check: bool = True) -> Result:
        return self.run("sh", "-euc", script, timeout=timeout, check=check)

    def moorage(self, *args: str, timeout: float = 120, check: bool = True) -> Result:
        return self.run(str(REPO / ".venv/bin/moorage"), *args, timeout=timeout, check=check)

    def spawn(self, name: str, *argv: str, log: str, env: dict[str, str] | None = None) -> int:
        answer = self.request(30, op="spawn", name=name, argv=list(argv), log=log, env=env or {},
                              cwd=str(REPO))  # fmt: skip
        return int(answer["pid"])

    def signal(self, name: str, sig: signal.Signals) -> None:
        self.request(30, op="signal", name=name, signal=sig.name)

    def wait(self, name: str, timeout: float) -> int | None:
        rc = self.request(timeout, op="wait", name=name, timeout=timeout)["rc"]
        return None if rc is None else int(rc)

    # -- tear-down

    def console_tail(self, lines: int = 40) -> str:
        try:
            text = self.console.read_text(errors="replace")
        except OSError:
            return "(no console output)"
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> list[str]:
        """Power the guest off (killed if it will not go), then everything in the
        namespace, then the namespace.  Returns what had to be killed."""
        killed: list[str] = []
        if self._conn is not None:
            with contextlib.suppress(OSError, GuestError):
                self._conn.sendall(b'{"op": "poweroff"}\n')
                self._read(10)
            self._conn.close()
            self._conn = None
        if self.qemu is not None:
            try:
                self.qemu.wait(60)
            except subprocess.TimeoutExpired:
                killed.append(f"qemu (pid {self.qemu.pid})")
                os.killpg(self.qemu.pid, signal.SIGKILL)
                self.qemu.wait(30)
        if self.netns in netns_list():
            killed += kill_netns_processes(self.netns)
            ip("netns", "delete", self.netns)
        return killed


@contextlib.contextmanager
def lane(guest_dir: Path, work: Path, extra: Sequence[Path] = ()) -> Iterator[Lane]:
    running = Lane(guest_dir, work, extra)
    try:
        running.create_network()
        running.boot()
        yield running
    finally:
        running.close()


def main() -> None:
    """``python -m tests.kernel.guest shell``: the guest with a shell on this terminal,
    and a storage node in the lane's namespace (``make kernel-shell``)."""
    import secrets
    import tempfile

    from tests.backend_node import make_node

    if sys.argv[1:] != ["shell"]:
        raise SystemExit("usage: python -m tests.kernel.guest shell")
    guest_dir = Path(os.environ.get("MOORAGE_GUEST", ""))
    if not (guest_dir / "base.cpio").is_file():
        raise SystemExit(f"no guest at {guest_dir!s}: run make kernel-shell (it builds one)")
    with tempfile.TemporaryDirectory(prefix="moorage-lane-") as tmp:
        running = Lane(guest_dir, Path(tmp), [Path(os.environ["MOORAGE_CSI_SANITY"])]
                       if os.environ.get("MOORAGE_CSI_SANITY") else [])  # fmt: skip
        node = make_node(Path(tmp) / "store")
        node.netns, node.nbd_host, node.nfs_advertise = running.netns, HOST_IP, HOST_IP
        token = secrets.token_hex(24)
        node.also_listen, node.token_file = f"{HOST_IP}:{API_PORT}", Path(tmp) / "token"
        node.token_file.write_text(token + "\n")
        node.token_file.chmod(0o600)
        try:
            running.create_network()
            node.start()
            print(f"storage node: NBD {HOST_IP}:{node.nbd_port}, NFS port {node.nfs_port}, "
                  f"MOUNT port {node.mount_port}; its API from this host: "
                  f"MOORAGE_BACKEND={node.address} moorage volume --token-file {node.token_file} "
                  f"...; from the guest: {node.also_listen} with the token {token}")  # fmt: skip
            print("the guest's console follows (Ctrl-A X quits QEMU)")
            running.shell()
        finally:
            try:
                node.teardown()
            finally:
                running.close()


if __name__ == "__main__":
    main()

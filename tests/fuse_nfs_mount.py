"""A real nfs-ganesha serving an export of a fresh tmpfs on free loopback ports (its
supervisor in a thread of its own), and FUSE NFS mounts of it (``python -m
fuse.nfsmount``) that are always unmounted and reaped, whatever the test's outcome."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from backend.ganesha.config import CoreConfig, ExportConfig
from backend.ganesha.files import GaneshaFiles
from backend.ganesha.supervisor import GaneshaSupervisor
from fuse.nfsmount import FSTYPE
from tests.conftest import REPO
from tests.ganesha_env import ganesha_workspace

TIMEOUT = 60


def mounted_here(path: Path) -> bool:
    """Whether /proc/mounts lists a file system on ``path``."""
    target = os.fsencode(path)
    with open("/proc/mounts", "rb") as mounts:
        return any(line.split()[1] == target for line in mounts)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def fuse_nfs_mounts() -> list[str]:
    with open("/proc/mounts") as mounts:
        return [line for line in mounts if f" fuse.{FSTYPE} " in line]


class SupervisorThread:
    """``GaneshaSupervisor.run`` in ``trio.run`` on a thread, so sync fixtures can share it."""

    def __init__(self, supervisor: GaneshaSupervisor) -> None:
        self.supervisor = supervisor
        self._up = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="ganesha", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._up.wait(TIMEOUT) or self._error is not None:
            self.stop()
            raise RuntimeError(f"ganesha did not start: {self._error!r}")

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as e:
            self._error = e
        finally:
            self._up.set()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.supervisor.run)
            self._up.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        if self._thread.is_alive() and self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread.is_alive():
            self._thread.join(TIMEOUT)


@dataclass
class Ganesha:
    base: Path
    core: CoreConfig
    export: ExportConfig
    files: GaneshaFiles

    @property
    def directory(self) -> Path:
        """The exported directory itself."""
        return self.export.path

    @property
    def spec(self) -> str:
        return f"127.0.0.1:{self.core.nfs_port}:{self.export.pseudo}"

    @property
    def mount_port(self) -> int:
        assert self.core.mount_port is not None
        return self.core.mount_port

    def url(self, name: str) -> str:
        """An ``nfs-cp`` URL (NFSv3, explicit ports) for ``name`` in the export."""
        return (
            f"nfs://127.0.0.1{self.export.pseudo}/{name}"
            f"?nfsport={self.core.nfs_port}&mountport={self.mount_port}&version=3"
        )


@contextmanager
def running_ganesha(size: str = "512m") -> Iterator[Ganesha]:
    """A tmpfs, an export of a directory on it, ganesha serving it; all gone afterwards."""
    with ganesha_workspace("moorage-fusenfs-", size) as ws:
        thread: SupervisorThread | None = None
        try:
            directory = ws.exports / "vol1"
            directory.mkdir()
            export = ExportConfig(
                export_id=1,
                path=directory,
                pseudo="/volumes/vol1",
                clients=("127.0.0.1",),
                squash="no_root_squash",
            )
            ws.files.sync([export])
            supervisor = GaneshaSupervisor(
                ws.files.main_file,
                ws.core,
                pid_file=ws.base / "run" / "ganesha.pid",
                stop_timeout=20,
            )
            thread = SupervisorThread(supervisor)
            thread.start()
            yield Ganesha(ws.base, ws.core, export, ws.files)
        finally:
            if thread is not None:
                thread.stop()
            # FUSE mounts below base (a test's leftovers) would keep the tmpfs busy
            for line in fuse_nfs_mounts():
                target = line.split()[1]
                if target.startswith(str(ws.base)):
                    subprocess.run(["fusermount3", "-u", "-z", target], timeout=30, check=False)


@dataclass
class FuseMount:
    proc: subprocess.Popen[bytes]
    mountpoint: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def read_line(fd: int, timeout: float) -> bytes:
    """A line from ``fd``; what came so far at EOF or after ``timeout``."""
    line = b""
    end = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not selector.select(left):
                break
            chunk = os.read(fd, 256)
            if not chunk:
                break
            line += chunk
    return line


def stop_mount(proc: subprocess.Popen[bytes], mountpoint: Path) -> None:
    """Unmount and reap, whatever state the mount and its process are in."""
    if mounted_here(mountpoint):
        result = subprocess.run(
            ["fusermount3", "-u", str(mountpoint)], capture_output=True, timeout=30, check=False
        )
        if result.returncode != 0:  # busy (a file left open by a failed test)
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], timeout=30, check=False)
            # detached, but served while the open file lasts: stop serving now
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if mounted_here(mountpoint):  # the process died without unmounting
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], timeout=30, check=False)
    if proc.stdout is not None:
        proc.stdout.close()


@contextmanager
def fuse_mount(ganesha: Ganesha, name: str, *args: str) -> Iterator[FuseMount]:
    """``python -m fuse.nfsmount`` on a new mount point; unmounted and reaped afterwards."""
    mountpoint = ganesha.base / "mnt" / name
    mountpoint.mkdir(parents=True)
    log = ganesha.base / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "fuse.nfsmount",
        ganesha.spec,
        str(mountpoint),
        "--mount-port",
        str(ganesha.mount_port),
        "--cache-timeout",
        "0",
        *args,
    ]
    with log.open("wb") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, cwd=REPO
        )
    try:
        assert proc.stdout is not None
        line = read_line(proc.stdout.fileno(), TIMEOUT)
        assert line == b"ready\n", f"{line!r}; log:\n{log.read_text(errors='replace')}"
        assert mounted_here(mountpoint)
        yield FuseMount(proc, mountpoint, log)
    finally:
        stop_mount(proc, mountpoint)


def mount_processes(mountpoint: Path) -> list[int]:
    """Pids of the ``fuse.nfsmount`` processes serving ``mountpoint``."""
    found = subprocess.run(
        ["pgrep", "-f", f"fuse.nfsmount .* {mountpoint} "],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return [int(pid) for pid in found.stdout.split()]

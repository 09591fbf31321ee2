"""A real nfs-ganesha 4.3, configured and supervised by ``backend.ganesha``.

Every test mounts a fresh tmpfs (ganesha cannot export overlayfs), writes the
configuration with :class:`GaneshaFiles`, runs :class:`GaneshaSupervisor` on
free loopback ports with no grace period, and talks to it with libnfs's
``nfs-cp``/``nfs-cat``/``nfs-ls``: NFSv3 with explicit ``nfsport`` and
``mountport`` (so no portmapper lookup), NFSv4 with ``nfsport``.  NFSv3 makes
ganesha register with rpcbind, so the supervisor starts one when none runs.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import pytest
import trio

from backend.api.errors import Unavailable
from backend.ganesha.config import CoreConfig, ExportConfig
from backend.ganesha.files import GaneshaFiles
from backend.ganesha.probes import RPCBIND_PORT, accepts_tcp
from backend.ganesha.supervisor import GaneshaSupervisor
from tests.ganesha_env import ganesha_pids, ganesha_workspace

TIMEOUT = 60
log = logging.getLogger(__name__)


# ------------------------------------------------------------------ helpers


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def own_rpcbind() -> int | None:
    """The pid of a live rpcbind this process started (a supervisor's child), if any."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, ppid = text.rsplit(")", 1)[1].split()[:2]
        if name == "rpcbind" and int(ppid) == os.getpid() and state != "Z":
            return int(stat.parent.name)
    return None


@dataclass
class NfsResult:
    returncode: int
    stdout: str
    stderr: str


async def nfs(*argv: str) -> NfsResult:
    result = await trio.run_process(
        list(argv), capture_stdout=True, capture_stderr=True, check=False
    )
    return NfsResult(
        result.returncode,
        result.stdout.decode(errors="replace"),
        result.stderr.decode(errors="replace"),
    )


@dataclass
class Node:
    """A storage node's ganesha side: a tmpfs to export, files, a supervisor."""

    base: Path
    exports: Path
    core: CoreConfig
    files: GaneshaFiles
    supervisor: GaneshaSupervisor

    def export(
        self,
        export_id: int,
        clients: tuple[str, ...] = ("127.0.0.1",),
        access: Literal["RW", "RO"] = "RW",
    ) -> ExportConfig:
        directory = self.exports / f"vol{export_id}"
        directory.mkdir(exist_ok=True)
        return ExportConfig(
            export_id=export_id,
            path=directory,
            pseudo=f"/volumes/vol{export_id}",
            clients=clients,
            access=access,
            squash="no_root_squash",
        )

    def v3(self, export: ExportConfig, name: str = "") -> str:
        port, mount = self.core.nfs_port, self.core.mount_port
        return f"nfs://127.0.0.1{export.pseudo}/{name}?nfsport={port}&mountport={mount}&version=3"

    def v4(self, pseudo: str) -> str:
        return f"nfs://127.0.0.1{pseudo}?version=4&nfsport={self.core.nfs_port}"

    @asynccontextmanager
    async def running(self) -> AsyncIterator[GaneshaSupervisor]:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(TIMEOUT):
                await nursery.start(self.supervisor.run)
            yield self.supervisor
            nursery.cancel_scope.cancel()


@pytest.fixture
def node(caplog: pytest.LogCaptureFixture) -> Iterator[Node]:
    caplog.set_level(logging.DEBUG, logger="moorage.ganesha")
    with ganesha_workspace("moorage-ganesha-", "64m") as ws:
        supervisor = GaneshaSupervisor(
            ws.files.main_file, ws.core, pid_file=ws.base / "run" / "ganesha.pid", stop_timeout=30
        )
        yield Node(ws.base, ws.exports, ws.core, ws.files, supervisor)


def ganesha_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moorage.ganesha"]


# ------------------------------------------------------------------ tests


async def test_export_for_a_client_is_readable_and_writable(node: Node, tmp_path: Path) -> None:
    one = node.export(1)
    node.files.sync([one])
    local = tmp_path / "hello.txt"
    local.write_bytes(b"hello over nfs\n" * 1000)
    async with node.running():
        copied = await nfs("nfs-cp", str(local), node.v3(one, "hello.txt"))
        assert copied.returncode == 0, copied
        assert (one.path / "hello.txt").read_bytes() == local.read_bytes()

        cat = await nfs("nfs-cat", node.v3(one, "hello.txt"))
        assert cat.returncode == 0, cat
        assert cat.stdout == local.read_text()

        listing = await nfs("nfs-ls", node.v3(one))
        assert listing.returncode == 0, listing
        assert "hello.txt" in listing.stdout

        root = await nfs("nfs-ls", node.v4("/"))
        assert root.returncode == 0, root
        assert root.stdout.split()[-1] == "volumes"
        volumes = await nfs("nfs-ls", node.v4("/volumes"))
        assert volumes.returncode == 0, volumes
        assert volumes.stdout.split()[-1] == "vol1"
        v4_listing = await nfs("nfs-ls", node.v4("/volumes/vol1"))
        assert v4_listing.returncode == 0, v4_listing
        # numeric owners over v4: root is 0, not "nobody"
        assert v4_listing.stdout.split()[2:4] == ["0", "0"]
        assert "hello.txt" in v4_listing.stdout


async def test_ganesha_reads_the_rendered_configuration_without_a_complaint(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    node.files.sync([node.export(1)])
    # %dir reads only *.conf: a half-written temp file must not be parsed
    (node.files.export_dir / ".export-2.conf.tmp").write_text('EXPORT { Path = "\n')
    async with node.running() as supervisor:
        node.files.write_export(node.export(3, clients=("127.0.0.1", "::1", "10.0.0.0/8")))
        assert await supervisor.reload_and_wait() is True
        assert await supervisor.reload_and_wait() is True
    messages = ganesha_messages(caplog)
    assert any("Starting: Ganesha Version 4.3" in m for m in messages)
    assert sum("Reread exports complete" in m for m in messages) == 2
    # an unknown option or a bad value shows up as config_errs_to_log
    assert [m for m in messages if "config_errs_to_log" in m or "Unknown" in m] == []


async def test_sighup_adds_and_removes_an_export_without_a_restart(node: Node) -> None:
    one, two = node.export(1), node.export(2)
    node.files.sync([one])
    async with node.running() as supervisor:
        pid = supervisor.pid
        refused = await nfs("nfs-ls", node.v3(two))
        assert refused.returncode != 0 and "MNT3ERR_ACCES" in refused.stderr, refused

        node.files.write_export(two)
        assert await supervisor.reload_and_wait() is True
        added = await nfs("nfs-ls", node.v3(two))
        assert added.returncode == 0, added
        assert (await nfs("nfs-ls", node.v4("/volumes/vol2"))).returncode == 0

        node.files.remove_export(2)
        # from a worker thread, as the service's blocking code would
        assert await trio.to_thread.run_sync(lambda: supervisor.reload_from_thread(wait=True))
        removed = await nfs("nfs-ls", node.v3(two))
        assert removed.returncode != 0 and "MNT3ERR_ACCES" in removed.stderr, removed
        removed_v4 = await nfs("nfs-ls", node.v4("/volumes/vol2"))
        assert removed_v4.returncode != 0, removed_v4
        assert (await nfs("nfs-ls", node.v3(one))).returncode == 0

        assert supervisor.pid == pid
        assert supervisor.restarts == 0


async def test_export_is_refused_to_a_client_not_on_its_list(node: Node, tmp_path: Path) -> None:
    nobody = node.export(1, clients=())
    elsewhere = node.export(2, clients=("10.9.9.9",))
    control = node.export(3)
    node.files.sync([nobody, elsewhere, control])
    local = tmp_path / "x.txt"
    local.write_text("x")
    async with node.running():
        assert (await nfs("nfs-ls", node.v3(control))).returncode == 0
        for export in (nobody, elsewhere):
            listing = await nfs("nfs-ls", node.v3(export))
            assert listing.returncode != 0 and "MNT3ERR_ACCES" in listing.stderr, listing
            copied = await nfs("nfs-cp", str(local), node.v3(export, "x.txt"))
            assert copied.returncode != 0, copied
            assert (await nfs("nfs-ls", node.v4(export.pseudo))).returncode != 0
            assert not (export.path / "x.txt").exists()


async def test_read_only_export_refuses_writes(node: Node, tmp_path: Path) -> None:
    ro = node.export(1, access="RO")
    node.files.sync([ro])
    (ro.path / "existing.txt").write_text("already here\n")
    local = tmp_path / "new.txt"
    local.write_text("new\n")
    async with node.running():
        cat = await nfs("nfs-cat", node.v3(ro, "existing.txt"))
        assert cat.returncode == 0 and cat.stdout == "already here\n", cat
        copied = await nfs("nfs-cp", str(local), node.v3(ro, "new.txt"))
        assert copied.returncode != 0 and "NFS3ERR_ROFS" in copied.stderr, copied
        assert not (ro.path / "new.txt").exists()


async def test_killed_ganesha_is_restarted_and_serves_again(node: Node) -> None:
    one = node.export(1)
    node.files.sync([one])
    (one.path / "data.txt").write_text("still here\n")
    async with node.running() as supervisor:
        old = supervisor.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        with trio.fail_after(TIMEOUT):
            while supervisor.pid in (None, old) or not supervisor.ready:
                await trio.sleep(0.05)
        assert supervisor.restarts == 1
        assert not pid_alive(old)
        cat = await nfs("nfs-cat", node.v3(one, "data.txt"))
        assert cat.returncode == 0 and cat.stdout == "still here\n", cat


async def test_restarts_back_off_while_ganesha_cannot_start(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    one = node.export(1)
    node.files.sync([one])
    supervisor = node.supervisor
    supervisor.backoff_initial, supervisor.backoff_max = 0.2, 0.8
    async with node.running():
        old = supervisor.pid
        assert old is not None
        # Every restart must exit at once, as behind a leftover ganesha: queue
        # for the pid file's lock, which ganesha holds, then kill it; the lock
        # passes to the test before any restart can take it.
        with supervisor.pid_file.open("a") as pid_file:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(trio.to_thread.run_sync, fcntl.lockf, pid_file, fcntl.LOCK_EX)
                )
                await trio.sleep(0.2)
                os.kill(old, signal.SIGKILL)
            with trio.fail_after(TIMEOUT):
                while sum("did not start" in m for m in ganesha_messages(caplog)) < 4:
                    await trio.sleep(0.05)
        with trio.fail_after(TIMEOUT):
            while supervisor.pid is None or not supervisor.ready:
                await trio.sleep(0.05)
        delays = [
            r.args[0]
            for r in caplog.records
            if r.msg == "restarting ganesha.nfsd in %.1fs" and isinstance(r.args, tuple)
        ]
        assert delays[:5] == [0.2, 0.4, 0.8, 0.8, 0.8]
        assert supervisor.restarts == 1
        assert (await nfs("nfs-ls", node.v3(one))).returncode == 0


async def test_stopping_the_supervisor_leaves_no_ganesha_and_no_rpcbind_of_its_own(
    node: Node,
) -> None:
    rpcbind_before = await accepts_tcp("127.0.0.1", RPCBIND_PORT)
    node.files.sync([node.export(1)])
    async with trio.open_nursery() as nursery:
        await nursery.start(node.supervisor.run)
        pid = node.supervisor.pid
        ours = own_rpcbind()
        assert pid is not None and pid_alive(pid)
        assert ganesha_pids(node.files.main_file) == [pid]
        assert node.supervisor.pid_file.read_text().strip() == str(pid)
        # it starts rpcbind exactly when none listened
        assert (ours is None) == rpcbind_before
        assert await accepts_tcp("127.0.0.1", RPCBIND_PORT)
        stopping = trio.current_time()
        nursery.cancel_scope.cancel()
    log.info("ganesha stopped %.1fs after cancellation", trio.current_time() - stopping)
    assert node.supervisor.pid is None
    assert not pid_alive(pid)
    assert ganesha_pids(node.files.main_file) == []
    assert not node.supervisor.pid_file.exists()
    if ours is not None:
        assert not pid_alive(ours)
    else:
        assert await accepts_tcp("127.0.0.1", RPCBIND_PORT)  # someone else's, left alone


async def test_nfs_port_in_use_is_unavailable_and_starts_nothing(node: Node) -> None:
    node.files.sync([node.export(1)])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", node.core.nfs_port))
        squatter.listen()
        with pytest.raises(Unavailable, match=f"127.0.0.1:{node.core.nfs_port} is already in use"):
            await node.supervisor.run()
    assert ganesha_pids(node.files.main_file) == []
    assert node.supervisor.pid is None


_HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "w")
fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("locked", flush=True)
time.sleep(600)
"""


async def test_ganesha_that_exits_at_start_is_unavailable_with_its_reason(node: Node) -> None:
    node.files.sync([node.export(1)])
    node.supervisor.pid_file.parent.mkdir(parents=True, exist_ok=True)
    # What a ganesha left over from an earlier run does: hold the pid file's
    # lock.  From another process: a POSIX lock of this process would be
    # dropped as soon as the supervisor closes the pid file after reading it.
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(node.supervisor.pid_file)],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"locked\n"
        with pytest.raises(Unavailable, match="before it answered") as failure:
            await node.supervisor.run()
    finally:
        holder.kill()
        holder.wait()
    assert "Ganesha already started" in str(failure.value)
    assert ganesha_pids(node.files.main_file) == []
    assert node.supervisor.pid is None

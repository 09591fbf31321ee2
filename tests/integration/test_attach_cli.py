"""``moorage attach|detach|mount|unmount`` and the probe behind them (``csi.attach``).

Two kinds of test here (the kernel paths with the kernel faked are unit
tests, ``tests/unit/test_attach_kernel_faked.py``; the kernel paths for real
run in the kernel lane, ``tests/kernel``):

- the probe on this host, through the real CLI in a subprocess: this kernel
  has no nbd module and no NFS client, so block is fuse-loop and NFS is
  fuse-nfs, and forcing a kernel path fails saying why;
- end to end through the CLI: an NBD export of a sparse image attached as a
  loop device, formatted, mounted, written, detached; an NFS export of a
  real ganesha mounted through FUSE and unmounted.

Every fixture undoes what it made (mounts, devices, processes) whatever the
test's outcome.

Why this file is long: it takes the four commands through both kinds of test above, and
the end-to-end runs bring their own fixtures (an NBD server and loop device, and a
module-scoped ganesha) with the teardown that undoes what they made.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from csi import attach, mounts
from moorage.cli import build_app
from nbd import kernel as nbd_kernel
from tests.conftest import REPO, NBDServerFactory, run, sparse_image
from tests.fuse_nfs_mount import Ganesha, mount_processes, running_ganesha

app = build_app()
MiB = 1 << 20
TIMEOUT = 60


def moorage(
    *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python -m moorage ARGS`` with no attach override from the caller's environment."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MOORAGE_BLOCK_PATH", "MOORAGE_NFS_PATH", "MOORAGE_ATTACH_STATE_DIR")
    }
    result = subprocess.run(
        [sys.executable, "-m", "moorage", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**base, **(env or {})},
        cwd=REPO,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"moorage {' '.join(args)} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result


# ------------------------------------------------------------------ the probe on this host


def test_probe_on_this_host_picks_the_fuse_paths_and_says_why() -> None:
    kernel_ok, kernel_reason = nbd_kernel.kernel_nbd_available()
    assert not kernel_ok, "this test documents a host without kernel nbd"
    out = moorage("attach", "probe").stdout
    lines = out.splitlines()
    assert lines[0] == "block: fuse-loop"
    assert "kernel nbd unavailable" in lines[1]
    assert "/dev/fuse" in lines[1] and "/dev/loop-control" in lines[1]
    assert lines[2] == "nfs: fuse-nfs"
    assert "kernel NFS client unavailable" in lines[3]

    plan = json.loads(moorage("attach", "probe", "--json").stdout)
    assert (plan["block"], plan["nfs"]) == ("fuse-loop", "fuse-nfs")
    assert plan["block_reason"].startswith(kernel_reason.split(":")[0])


def test_forcing_a_path_this_host_lacks_fails_with_the_reason(tmp_path: Path) -> None:
    result = moorage("attach", "probe", env={"MOORAGE_BLOCK_PATH": "kernel-nbd"}, check=False)
    assert result.returncode == 1
    assert "MOORAGE_BLOCK_PATH=kernel-nbd cannot be used on this host" in result.stderr
    assert "kernel nbd unavailable" in result.stderr

    result = moorage("attach", "probe", env={"MOORAGE_NFS_PATH": "kernel-nfs"}, check=False)
    assert result.returncode == 1
    assert "MOORAGE_NFS_PATH=kernel-nfs cannot be used on this host" in result.stderr

    # the commands that act refuse the same way, before touching anything
    state = tmp_path / "state"
    result = moorage(
        "attach",
        "nbd",
        "nbd://127.0.0.1:1/x",
        "--state-dir",
        str(state),
        env={"MOORAGE_BLOCK_PATH": "kernel-nbd"},
        check=False,
    )
    assert result.returncode == 1 and "kernel nbd unavailable" in result.stderr
    assert not state.exists()

    result = moorage("attach", "probe", env={"MOORAGE_BLOCK_PATH": "bogus"}, check=False)
    assert result.returncode == 1
    assert "expected auto, kernel-nbd or fuse-loop" in result.stderr


def test_forcing_an_available_path_says_so() -> None:
    out = moorage(
        "attach", "probe", env={"MOORAGE_BLOCK_PATH": "fuse-loop", "MOORAGE_NFS_PATH": "auto"}
    ).stdout
    assert "forced by MOORAGE_BLOCK_PATH" in out
    assert "nfs: fuse-nfs" in out


def test_every_command_has_help() -> None:
    for command in (
        ["attach"],
        ["attach", "nbd"],
        ["attach", "list"],
        ["attach", "probe"],
        ["detach"],
        ["mount"],
        ["mount", "nfs"],
        ["unmount"],
    ):
        out = moorage(*command, "--help").stdout
        assert "Usage:" in out, command


# ------------------------------------------------------------------ kernel paths, faked

runner = CliRunner()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_unmount_refuses_what_is_not_nfs(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    mounts.bind_mount(source, target)
    try:
        result = runner.invoke(app, ["unmount", str(target)])
        assert result.exit_code == 1
        assert "is not an NFS mount" in result.stderr
        assert mounts.mount_entry(target) is not None
    finally:
        mounts.unmount(target)
    assert invoke("unmount", str(target)).exit_code == 0  # nothing mounted: no-op


# ------------------------------------------------------------------ end to end: block


def loop_devices_of(image: Path) -> list[str]:
    out = run(["losetup", "--noheadings", "-O", "NAME,BACK-FILE", "-l"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()[1:] == [str(image)]]


@dataclass
class BlockEnv:
    state: Path
    mnt: Path


@pytest.fixture
def block_env(tmp_path: Path) -> Iterator[BlockEnv]:
    env = BlockEnv(state=tmp_path / "state", mnt=tmp_path / "mnt")
    env.mnt.mkdir()
    try:
        yield env
    finally:
        try:
            mounts.unmount(env.mnt)
        except mounts.MountError:
            mounts.unmount(env.mnt, lazy=True)
        for a in attach.list_block_attachments(env.state):
            with contextlib.suppress(attach.AttachError):
                attach.detach_block(a.device, env.state)


def test_an_nbd_export_attached_formatted_mounted_and_detached_through_the_cli(
    nbd_servers: NBDServerFactory, tmp_path: Path, block_env: BlockEnv
) -> None:
    image = sparse_image(tmp_path / "vol.img", 64 * MiB)
    server = nbd_servers.start({"x": image})
    uri = server.uri("x")
    state = str(block_env.state)

    device = moorage("attach", "nbd", uri, "--state-dir", state).stdout.strip()
    assert device.startswith("/dev/loop"), device
    assert Path(device).is_block_device()
    # again: the same device, nothing new attached
    assert moorage("attach", "nbd", uri, "--state-dir", state).stdout.strip() == device

    listed = json.loads(moorage("attach", "list", "--json", "--state-dir", state).stdout)
    assert [(a["device"], a["uri"], a["path"]) for a in listed] == [(device, uri, "fuse-loop")]
    assert device in moorage("attach", "list", "--state-dir", state).stdout

    assert mounts.format_device(device, "ext4") is True
    mounts.mount(device, block_env.mnt, "ext4")
    payload = os.urandom(3 * MiB)
    (block_env.mnt / "payload.bin").write_bytes(payload)
    # a mounted device is not detached: the FUSE process must outlive its users
    busy = moorage("detach", device, "--state-dir", state, check=False)
    assert busy.returncode == 1 and device in busy.stderr, busy.stderr
    assert [a.device for a in attach.list_block_attachments(block_env.state)] == [device]
    mounts.unmount(block_env.mnt)

    moorage("detach", device, "--state-dir", state)
    assert json.loads(moorage("attach", "list", "--json", "--state-dir", state).stdout) == []
    assert not any(a.device == device for a in attach.list_block_attachments(block_env.state))
    moorage("detach", device, "--state-dir", state)  # again: no-op

    # what was written went through NBD into the image: read it back without a mount
    out = subprocess.run(
        ["debugfs", "-R", "cat /payload.bin", str(image)],
        capture_output=True,
        timeout=TIMEOUT,
        check=True,
    )
    assert out.stdout == payload


# ------------------------------------------------------------------ end to end: NFS


@pytest.fixture(scope="module")
def ganesha() -> Iterator[Ganesha]:
    with running_ganesha(size="64m") as g:
        yield g


@pytest.fixture
def nfs_mountpoint(ganesha: Ganesha) -> Iterator[Path]:
    mountpoint = ganesha.base / "mnt" / f"cli-{uuid.uuid4().hex[:8]}"
    mountpoint.mkdir(parents=True)
    try:
        yield mountpoint
    finally:
        if mounts.mount_entry(mountpoint) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], timeout=30, check=False)
        for pid in mount_processes(mountpoint):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def wait_gone(mountpoint: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while mount_processes(mountpoint):
        assert time.monotonic() < deadline, "the FUSE mount process outlived its mount"
        time.sleep(0.05)


def test_an_nfs_export_mounted_and_unmounted_through_the_cli(
    ganesha: Ganesha, nfs_mountpoint: Path
) -> None:
    spec = f"127.0.0.1:{ganesha.core.nfs_port}:{ganesha.export.pseudo}"
    options = ["--mount-port", str(ganesha.mount_port), "--state-dir", str(ganesha.base / "state")]
    moorage("mount", "nfs", spec, str(nfs_mountpoint), *options)
    entry = mounts.mount_entry(nfs_mountpoint)
    assert entry is not None and entry.fstype == "fuse.moorage-nfs"
    assert len(mount_processes(nfs_mountpoint)) == 1  # it outlived the command that started it
    assert list((ganesha.base / "state" / "fuse-nfs").glob(f"{nfs_mountpoint.name}-*.log"))

    name = f"cli-{uuid.uuid4().hex[:6]}.txt"
    (nfs_mountpoint / name).write_text("through moorage mount nfs\n")
    assert (ganesha.directory / name).read_text() == "through moorage mount nfs\n"

    # the same export again: already there, nothing new
    moorage("mount", "nfs", spec, str(nfs_mountpoint), *options)
    assert len([e for e in mounts.mount_entries() if e.mount_point == str(nfs_mountpoint)]) == 1

    moorage("unmount", str(nfs_mountpoint))
    assert mounts.mount_entry(nfs_mountpoint) is None
    wait_gone(nfs_mountpoint)
    moorage("unmount", str(nfs_mountpoint))  # again: no-op
    (ganesha.directory / name).unlink()


def test_unmount_never_looks_into_the_mount(ganesha: Ganesha, nfs_mountpoint: Path) -> None:
    """``moorage unmount`` of a FUSE NFS mount whose process answers nothing (stopped,
    as good as a server gone and a bound not yet passed) returns: neither the command's
    argument nor the unmount stats into the mount."""
    spec = f"127.0.0.1:{ganesha.core.nfs_port}:{ganesha.export.pseudo}"
    options = ["--mount-port", str(ganesha.mount_port), "--state-dir", str(ganesha.base / "state")]
    moorage("mount", "nfs", spec, str(nfs_mountpoint), *options)
    (process,) = mount_processes(nfs_mountpoint)
    os.kill(process, signal.SIGSTOP)
    try:
        time.sleep(2)  # past the mount's attribute cache: a stat would reach the process
        moorage("unmount", str(nfs_mountpoint))  # within the helper's timeout
        assert mounts.mount_entry(nfs_mountpoint) is None
    finally:
        os.kill(process, signal.SIGCONT)
    wait_gone(nfs_mountpoint)


def test_a_read_only_nfs_mount_refuses_writes(ganesha: Ganesha, nfs_mountpoint: Path) -> None:
    (ganesha.directory / "ro-visible.txt").write_text("seen\n")
    spec = f"127.0.0.1:{ganesha.core.nfs_port}:{ganesha.export.pseudo}"
    moorage(
        "mount",
        "nfs",
        spec,
        str(nfs_mountpoint),
        "--mount-port",
        str(ganesha.mount_port),
        "--state-dir",
        str(ganesha.base / "state"),
        "--read-only",
    )
    assert (nfs_mountpoint / "ro-visible.txt").read_text() == "seen\n"
    with pytest.raises(OSError) as caught:
        (nfs_mountpoint / "nope.txt").write_text("x")
    assert caught.value.errno == errno.EROFS
    assert not (ganesha.directory / "nope.txt").exists()
    moorage("unmount", str(nfs_mountpoint))
    assert mounts.mount_entry(nfs_mountpoint) is None
    wait_gone(nfs_mountpoint)
    (ganesha.directory / "ro-visible.txt").unlink()


def test_a_refused_nfs_mount_says_why(ganesha: Ganesha, nfs_mountpoint: Path) -> None:
    spec = f"127.0.0.1:{ganesha.core.nfs_port}:/volumes/not-exported"
    result = moorage(
        "mount",
        "nfs",
        spec,
        str(nfs_mountpoint),
        "--mount-port",
        str(ganesha.mount_port),
        "--state-dir",
        str(ganesha.base / "state"),
        check=False,
    )
    assert result.returncode == 1
    assert "MNT3ERR_ACCES" in result.stderr
    assert mounts.mount_entry(nfs_mountpoint) is None

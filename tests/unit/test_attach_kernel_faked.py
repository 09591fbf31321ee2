"""The kernel paths of ``csi.attach`` and the ``moorage attach|mount`` commands, as unit
tests: the host facts and the kernel calls are faked (this host's kernel has neither
nbd nor an NFS client), so these check only our side: what gets recorded, which argv
runs, what is refused before anything is touched.  The kernel paths for real run in
the kernel lane (``make test-kernel``, tests/kernel).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from csi import attach
from csi.attach import block, paths
from csi.mounts import tools
from moorage.cli import build_app
from nbd import client as nbd_client
from nbd import kernel as nbd_kernel

app = build_app()
runner = CliRunner()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


@dataclass
class FakeKernel:
    attached: list[str]
    detached: list[str]
    sockets: list[socket.socket]


@pytest.fixture
def fake_kernel_nbd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeKernel:
    """A host whose kernel has nbd: probe says so, attach/detach are recorded, sysfs faked."""
    sys_block = tmp_path / "sys-block"
    sys_block.mkdir()
    fake = FakeKernel([], [], [])
    monkeypatch.delenv("MOORAGE_BLOCK_PATH", raising=False)
    monkeypatch.setattr(
        nbd_kernel,
        "kernel_nbd_available",
        lambda **_: (True, "kernel nbd available: generic netlink family 'nbd' (id 33)"),
    )
    monkeypatch.setattr(nbd_kernel, "SYS_BLOCK", sys_block)

    @dataclass
    class Negotiated:
        sock: socket.socket

    def connect_uri(uri: str, timeout: float = 30.0) -> Negotiated:
        a, b = socket.socketpair()
        b.close()
        fake.sockets.append(a)
        return Negotiated(a)

    def attach_kernel(negotiated: Negotiated, **kwargs: object) -> str:
        fake.attached.append(str(kwargs.get("backend_identifier")))
        (sys_block / "nbd3").mkdir()
        (sys_block / "nbd3" / "pid").write_text("1\n")
        return "/dev/nbd3"

    def detach_kernel(device: str) -> None:
        fake.detached.append(device)
        (sys_block / "nbd3" / "pid").unlink()

    monkeypatch.setattr(nbd_client, "connect_uri", connect_uri)
    monkeypatch.setattr(nbd_kernel, "attach_kernel", attach_kernel)
    monkeypatch.setattr(nbd_kernel, "detach_kernel", detach_kernel)
    return fake


def test_kernel_nbd_attach_is_recorded_listed_repeated_and_detached(
    fake_kernel_nbd: FakeKernel, tmp_path: Path
) -> None:
    state = str(tmp_path / "state")
    uri = "nbd://10.0.0.5:10809/vol-1"
    plan = attach.probe({})
    assert plan.block == "kernel-nbd"
    assert "generic netlink" in plan.block_reason

    result = invoke("attach", "nbd", uri, "--state-dir", state)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "/dev/nbd3"
    assert fake_kernel_nbd.attached == [uri]  # the URI is the kernel's backend identifier
    # the kernel holds its own reference: ours is closed
    assert [s.fileno() for s in fake_kernel_nbd.sockets] == [-1]
    # attaching the same URI again answers the same device, without a second attach
    assert invoke("attach", "nbd", uri, "--state-dir", state).stdout.strip() == "/dev/nbd3"
    assert len(fake_kernel_nbd.attached) == 1

    listed = json.loads(invoke("attach", "list", "--json", "--state-dir", state).stdout)
    assert listed == [
        {"device": "/dev/nbd3", "uri": uri, "path": "kernel-nbd", "mountpoint": None, "pid": None}
    ]
    table = invoke("attach", "list", "--state-dir", state).stdout
    assert "/dev/nbd3" in table and "kernel-nbd" in table

    assert invoke("detach", "/dev/nbd3", "--state-dir", state).exit_code == 0
    assert fake_kernel_nbd.detached == ["/dev/nbd3"]
    assert json.loads(invoke("attach", "list", "--json", "--state-dir", state).stdout) == []
    # detaching again: nothing attached, nothing done
    assert invoke("detach", "/dev/nbd3", "--state-dir", state).exit_code == 0
    assert invoke("detach", uri, "--state-dir", state).exit_code == 0
    assert fake_kernel_nbd.detached == ["/dev/nbd3"]


def test_a_kernel_record_whose_device_is_gone_is_replaced(
    fake_kernel_nbd: FakeKernel, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    uri = "nbd://10.0.0.5/vol-2"
    (state / block.KERNEL_STATE).mkdir(parents=True)
    stale = {"device": "/dev/nbd7", "uri": uri}
    (state / block.KERNEL_STATE / "nbd7.json").write_text(json.dumps(stale))
    assert [a.device for a in attach.list_block_attachments(state)] == ["/dev/nbd7"]
    # /dev/nbd7 is not connected (no sysfs pid): attach again, and forget the old record
    assert attach.attach_block(uri, state, attach.probe({})) == "/dev/nbd3"
    assert [a.device for a in attach.list_block_attachments(state)] == ["/dev/nbd3"]
    assert fake_kernel_nbd.detached == []


def test_a_bad_nbd_uri_is_refused_before_connecting(
    fake_kernel_nbd: FakeKernel, tmp_path: Path
) -> None:
    result = runner.invoke(app, ["attach", "nbd", "http://x/y", "--state-dir", str(tmp_path / "s")])
    assert result.exit_code == 1
    assert "not an NBD URI" in result.stderr
    assert fake_kernel_nbd.attached == []


@pytest.fixture
def kernel_nfs_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """A host with a kernel NFS client; the tools csi.mounts runs are recorded, not run."""
    filesystems = tmp_path / "filesystems"
    filesystems.write_text("nodev\tsysfs\nnodev\tnfs\nnodev\tnfs4\n\text4\n")
    helper = tmp_path / "mount.nfs4"
    helper.write_text("#!/bin/sh\nexit 0\n")
    helper.chmod(0o755)
    monkeypatch.delenv("MOORAGE_NFS_PATH", raising=False)
    monkeypatch.setattr(paths, "PROC_FILESYSTEMS", filesystems)
    monkeypatch.setattr(paths, "MOUNT_NFS4", (helper,))
    calls: list[list[str]] = []

    def fake_run(argv: Sequence[str], timeout: float, ok: Sequence[int] = (0,)) -> None:
        calls.append(list(argv))

    monkeypatch.setattr(tools, "run", fake_run)
    return calls


def test_kernel_nfs_mount_is_one_nfs4_mount_argv(
    kernel_nfs_host: list[list[str]], tmp_path: Path
) -> None:
    plan = attach.probe({})
    assert plan.nfs == "kernel-nfs"
    assert "nfs in" in plan.nfs_reason or "nfs4 in" in plan.nfs_reason
    target = tmp_path / "mnt dir"
    target.mkdir()
    assert invoke("mount", "nfs", "10.1.2.3:/volumes/v1", str(target), "--read-only").exit_code == 0
    assert invoke("mount", "nfs", "nfs.example:20490:/volumes/v2", str(target)).exit_code == 0
    assert invoke("mount", "nfs", "[fd00::1]:/v3", str(target)).exit_code == 0
    assert kernel_nfs_host == [
        [
            "mount",
            "-t",
            "nfs4",
            "-o",
            "port=2049,vers=4.1,soft,timeo=200,retrans=2,ro",
            "--",
            "10.1.2.3:/volumes/v1",
            str(target),
        ],
        [
            "mount",
            "-t",
            "nfs4",
            "-o",
            "port=20490,vers=4.1,soft,timeo=200,retrans=2",
            "--",
            "nfs.example:/volumes/v2",
            str(target),
        ],
        [
            "mount",
            "-t",
            "nfs4",
            "-o",
            "port=2049,vers=4.1,soft,timeo=200,retrans=2",
            "--",
            "[fd00::1]:/v3",
            str(target),
        ],
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-path", "expected SERVER[:PORT]:/PATH"),
        ("host:99999:/x", "port out of range"),
        ("host:/x,rw", "export path must be an absolute path"),
        ("ho st:/x", "must be a host name or address"),
    ],
)
def test_bad_nfs_exports_are_refused(
    kernel_nfs_host: list[list[str]], tmp_path: Path, spec: str, message: str
) -> None:
    result = runner.invoke(app, ["mount", "nfs", spec, str(tmp_path)])
    assert result.exit_code != 0
    assert message in result.output + result.stderr
    assert kernel_nfs_host == []


def test_a_host_with_no_path_at_all_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MOORAGE_BLOCK_PATH", raising=False)
    monkeypatch.setattr(paths, "DEV_FUSE", tmp_path / "no-fuse")
    monkeypatch.setattr(
        nbd_kernel, "kernel_nbd_available", lambda **_: (False, "kernel nbd unavailable: test")
    )
    plan = attach.probe({})
    assert plan.block is None and plan.nfs is None
    assert "kernel nbd unavailable: test" in plan.block_reason
    assert "no-fuse" in plan.block_reason
    out = invoke("attach", "probe").stdout
    assert "block: none" in out and "nfs: none" in out
    with pytest.raises(attach.PathUnavailable, match="no block path"):
        attach.attach_block("nbd://h/x", tmp_path, plan)


def test_configuration_keys_are_checked() -> None:
    with pytest.raises(attach.PathUnavailable, match="unknown attach configuration"):
        attach.probe({"block": "fuse-loop"})
    plan = attach.probe({"block_path": "fuse-loop", "nfs_path": "fuse-nfs"})
    assert "forced by block_path" in plan.block_reason

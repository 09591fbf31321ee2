"""FUSE processes moved out of their starter's cgroups (fuse/cgroup.py).

In Kubernetes this is what lets them outlive a restart of the node plugin's
container (the e2e kills the plugin's container to prove it); here the
moves themselves are checked against this host's real cgroup hierarchies.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi import attach
from fuse import cgroup
from tests.conftest import NBDServerFactory, sparse_image


def cgroups_of(pid: int) -> dict[str, str]:
    """hierarchy (controllers) -> path, from /proc/PID/cgroup."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        out[controllers or "unified"] = path
    return out


@pytest.fixture
def name() -> Iterator[str]:
    name = f"moorage-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    yield name
    for hierarchy in cgroup.hierarchies():
        directory = hierarchy / name
        for _ in range(50):  # its processes are gone a moment after they are killed
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def test_a_process_is_moved_into_the_named_cgroup_of_every_hierarchy(name: str) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        joined = cgroup.adopt(proc.pid, name)
        assert joined, "no cgroup hierarchy took the process"
        paths = cgroups_of(proc.pid)
        assert {d.parent.name for d in joined} >= {"pids", "memory"} or "unified" in paths
        for directory in joined:
            assert str(proc.pid) in (directory / "cgroup.procs").read_text().split()
        assert any(path == f"/{name}" for path in paths.values()), paths
    finally:
        proc.kill()
        proc.wait()


def test_nothing_moves_without_a_name_and_a_bad_name_moves_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cgroup.ENV, raising=False)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        before = cgroups_of(proc.pid)
        assert cgroup.adopt(proc.pid) == []
        assert cgroup.adopt(proc.pid, "../escape") == []
        assert cgroups_of(proc.pid) == before
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(cgroup.CgroupError):
        cgroup.check_name("a/b")


def test_the_fuse_block_file_process_lives_in_the_configured_cgroup(
    name: str, tmp_path: Path, nbd_servers: NBDServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cgroup.ENV, name)
    image = sparse_image(tmp_path / "disk.img", 16 << 20)
    server = nbd_servers.start({"disk": image})
    state = tmp_path / "attach"
    uri = server.uri("disk")
    plan = attach.probe()
    attach.attach_block(uri, state, plan)
    try:
        (found,) = [a for a in attach.list_block_attachments(state) if a.uri == uri]
        assert found.pid is not None
        assert any(p == f"/{name}" for p in cgroups_of(found.pid).values())
    finally:
        with contextlib.suppress(attach.AttachError):
            attach.detach_block(uri, state)

"""A dev-cluster node's process 1: PID and mount namespaces of the node's own.

Kubernetes' storage suite enters a node's mount namespace from a host-exec pod
with ``nsenter --mount=/rootfs/proc/1/ns/mnt``; this machine's own process 1
refuses that even to root, so each node of the dev cluster has a process 1
of its own (moorage_dev.devcluster.nodeinit) whose namespaces its daemons join.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moorage_dev.devcluster import node as nodes
from moorage_dev.devcluster import procs
from moorage_dev.devcluster.layout import Layout, Node
from tests.netns import ip


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Layout, Node]]:
    layout = Layout(root=tmp_path)
    node = Node(1, f"t{os.getpid()}", tmp_path)
    ip("netns", "add", node.netns)
    try:
        yield layout, node
    finally:
        nodes.stop_init(layout, node)
        for name in procs.known(layout):
            procs.stop(layout, name, timeout=5)
        ip("netns", "del", node.netns)


def _in_node(init: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", f"--target={init}", "--mount", "--pid", "--", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_node_has_a_process_1_its_daemons_and_host_exec_pods_reach(
    node: tuple[Layout, Node], tmp_path: Path
) -> None:
    layout, n = node
    nodes.start_init(layout, n)
    init = nodes.init_pid(layout, n)
    # the node's /proc is its own: process 1 there is the node's init
    cmdline = _in_node(init, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert "moorage_dev.devcluster.nodeinit" in cmdline, cmdline
    # what a host-exec pod runs: enter the mount namespace of the node's process 1
    entered = _in_node(init, "nsenter", "--mount=/proc/1/ns/mnt", "--", "cat", "/proc/1/cmdline")
    assert entered.returncode == 0, entered.stderr
    # a daemon started inside knows itself by the node's numbering; the host
    # records its own pid for it, and signals that one
    said = tmp_path / "pid-inside"
    pid = procs.start(
        layout,
        "daemon",
        ["sh", "-c", f"echo $$ > {said}; exec sleep 600"],
        netns=n.netns,
        inside=init,
    )
    deadline = time.monotonic() + 10
    while not said.exists() or not said.read_text().strip():
        assert time.monotonic() < deadline, "the daemon never wrote its pid"
        time.sleep(0.05)
    inside = int(said.read_text())
    assert inside != pid and inside < pid
    status = Path(f"/proc/{pid}/status").read_text()
    assert f"NSpid:\t{pid}\t{inside}" in status, status
    assert procs.running(layout, "daemon")
    # the node's process 1 stopped: every process of the node ends with it
    nodes.stop_init(layout, n)
    deadline = time.monotonic() + 10
    while procs.running(layout, "daemon"):
        assert time.monotonic() < deadline, "the node's daemon outlived its process 1"
        time.sleep(0.05)


def test_the_node_keeps_no_copy_of_other_programs_mounts_under_tmp(
    node: tuple[Layout, Node], tmp_path: Path
) -> None:
    """A test's mount under /tmp when the node starts is not pinned by the node's
    copy of the mount table, and taking it out of the copy leaves the host's."""
    layout, n = node
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(foreign)], check=True)
    try:
        # shared, as a test's Bidirectional kubelet directory is: an unmount in a
        # peer would reach the host's
        subprocess.run(["mount", "--make-shared", str(foreign)], check=True)
        (foreign / "mark").write_text("here\n")
        nodes.start_init(layout, n)
        init = nodes.init_pid(layout, n)
        inside = Path(f"/proc/{init}/mountinfo").read_text()
        assert f" {foreign} " not in inside, inside
        assert (foreign / "mark").read_text() == "here\n"
        assert any(
            line.split()[4] == str(foreign)
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
        )
    finally:
        nodes.stop_init(layout, n)
        subprocess.run(["umount", str(foreign)], check=True)

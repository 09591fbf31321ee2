"""The node plugin starts only where its mounts reach kubelet (issue 18, item 5).

A tmpfs under the test's directory stands in for kubelet's directory on the
host, made shared (as kubelet makes its root directory) or private. The
plugin runs in a mount namespace of its own, made by ``unshare`` as a
container runtime makes a pod's: ``--propagation private`` is a pod whose
kubelet-dir mount has no propagation, ``slave`` one with HostToContainer,
``unchanged`` one with Bidirectional.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from csi import mounts
from tests.conftest import REPO, run
from tests.csi_plugin import CsiPlugin

FIX = "mount propagation of the kubelet dir must be Bidirectional/shared"


@pytest.fixture
def kubelet_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty tmpfs of its own; the test sets its propagation."""
    path = tmp_path / "kubelet"
    path.mkdir()
    run(["mount", "-t", "tmpfs", "-o", "size=16m", "moorage-kubelet", str(path)])
    try:
        yield path
    finally:
        for target in sorted(
            (e.mount_point for e in mounts.mount_entries() if e.mount_point.startswith(str(path))),
            key=len,
            reverse=True,
        ):
            if run(["umount", "--", target], check=False).returncode != 0:
                run(["umount", "-l", "--", target], check=False)
        assert mounts.mount_entry(path) is None


def serve(root: Path, kubelet: Path, propagation: str, *extra: str) -> list[str]:
    """``moorage csi serve --mode node`` in a new mount namespace."""
    return [
        "unshare", "--mount", "--propagation", propagation, "--",
        sys.executable, "-m", "moorage", "csi", "serve",
        "--endpoint", f"unix://{root}/csi.sock", "--mode", "node",
        "--node-id", "n1", "--node-address", "127.0.0.1",
        "--state-dir", str(root / "state"), "--kubelet-dir", str(kubelet), *extra,
    ]  # fmt: skip


@dataclass
class NamespacedPlugin(CsiPlugin):
    """A node plugin in a mount namespace of its own (``unshare`` execs it: one process)."""

    propagation: str = "unchanged"

    def argv(self) -> list[str]:
        return ["unshare", "--mount", "--propagation", self.propagation, "--", *super().argv()]


@pytest.mark.parametrize(
    ("host", "namespace", "reason"),
    [
        ("shared", "private", "which is private: mounts made on it never leave"),
        ("shared", "slave", "which is a slave (HostToContainer)"),
        ("private", "unchanged", "which is private: mounts made on it never leave"),
    ],
    ids=["pod-without-propagation", "pod-host-to-container", "private-on-the-host"],
)
def test_a_plugin_whose_mounts_would_not_reach_the_host_refuses_to_start(
    host: str, namespace: str, reason: str, kubelet_dir: Path, tmp_path: Path
) -> None:
    run(["mount", f"--make-{host}", str(kubelet_dir)])
    argv = serve(tmp_path, kubelet_dir, namespace)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"moorage csi: {FIX}: {kubelet_dir} lies on the mount at {kubelet_dir}, {reason}"
    ), lines[0]
    assert "mountPropagation: Bidirectional" in lines[0]
    # refused before anything was made
    assert not (tmp_path / "csi.sock").exists()
    assert not (tmp_path / "state").exists()
    assert [e for e in mounts.mount_entries() if e.mount_point.startswith(str(kubelet_dir))] == [
        mounts.mount_entry(kubelet_dir)
    ]


def test_a_plugin_whose_kubelet_dir_is_shared_starts_and_its_mounts_reach_the_host(
    kubelet_dir: Path, tmp_path: Path
) -> None:
    run(["mount", "--make-shared", str(kubelet_dir)])
    plugin = NamespacedPlugin(
        tmp_path / "plugin", "node", allow_private_mounts=False,
        extra_args=["--kubelet-dir", str(kubelet_dir)],
    )  # fmt: skip
    try:
        plugin.start()
        assert plugin.proc is not None
        assert "mounts under" in plugin.log_text() and "propagate" in plugin.log_text()
        # what starting promised: a mount made in the plugin's namespace shows on the host
        probe = kubelet_dir / "probe"
        probe.mkdir()
        pid = plugin.proc.pid
        run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "mount", "-t", "tmpfs", "p", str(probe)])
        seen = mounts.mount_entry(probe)
        assert seen is not None and seen.source == "p"
    finally:
        plugin.stop()


def test_the_opt_out_starts_a_plugin_in_a_private_namespace_and_says_so(
    kubelet_dir: Path, tmp_path: Path
) -> None:
    run(["mount", "--make-shared", str(kubelet_dir)])
    plugin = NamespacedPlugin(
        tmp_path / "plugin", "node", propagation="private", allow_private_mounts=True,
        extra_args=["--kubelet-dir", str(kubelet_dir)],
    )  # fmt: skip
    try:
        plugin.start()
        assert "--allow-private-mounts: mount propagation of" in plugin.log_text()
    finally:
        plugin.stop()

"""``moorage csi serve`` refuses bad registration and health options before serving.

Each case runs the real command: exit status 2, one line on standard error
naming the option, and no socket left behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

NODE = ["--mode", "node", "--node-id", "n1", "--node-address", "127.0.0.1"]
HOST_PATH = "/var/lib/kubelet/plugins/csi.moorage.dev/csi.sock"


def serve(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "moorage", "csi", "serve"]
    argv += ["--endpoint", f"unix://{tmp}/csi.sock", "--state-dir", str(tmp / "state"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)


CASES = {
    "dir-without-host-path": (
        [*NODE, "--registration-dir", "{tmp}/registry"],
        "--registration-dir needs --kubelet-registration-path",
    ),
    "host-path-without-dir": (
        [*NODE, "--kubelet-registration-path", HOST_PATH],
        "--kubelet-registration-path is used only with --registration-dir",
    ),
    "controller-mode": (
        ["--mode", "controller", "--registration-dir", "{tmp}/registry",
         "--kubelet-registration-path", HOST_PATH],
        "--registration-dir is for the node plugin",
    ),
    "relative-dir": (
        [*NODE, "--registration-dir", "registry", "--kubelet-registration-path", HOST_PATH],
        "--registration-dir 'registry' is not an absolute path",
    ),
    "relative-host-path": (
        [*NODE, "--registration-dir", "{tmp}/registry", "--kubelet-registration-path", "csi.sock"],
        "--kubelet-registration-path 'csi.sock' is not an absolute path",
    ),
    "host-path-as-an-endpoint": (
        [*NODE, "--registration-dir", "{tmp}/registry",
         "--kubelet-registration-path", "unix://" + HOST_PATH],
        "is not an absolute path",
    ),
    "health-address-without-port": (
        [*NODE, "--health-address", "0.0.0.0"],
        "--health-address '0.0.0.0' is not HOST:PORT",
    ),
    "health-address-port-out-of-range": (
        [*NODE, "--health-address", "127.0.0.1:70000"],
        "--health-address '127.0.0.1:70000' is not HOST:PORT",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_registration_and_health_options_stop_the_plugin_in_one_line(
    case: str, tmp_path: Path
) -> None:
    args, message = CASES[case]
    result = serve(tmp_path, *(a.format(tmp=tmp_path) for a in args))
    assert result.returncode == 2, result
    assert result.stderr.startswith("moorage csi: "), result.stderr
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "csi.sock").exists()
    assert not (tmp_path / "registry").exists()


def test_the_node_plugin_refuses_an_address_no_storage_node_accepts(tmp_path: Path) -> None:
    """The rule the storage node applies to a node's address (issue 17):
    checked at start, not when the first publish fails."""
    for address in ("0.0.0.0", "::", "fe80::1%eth0", "::ffff:10.77.0.12", "255.255.255.255"):
        args = ["--mode", "node", "--node-id", "n1", "--node-address", address]
        result = serve(tmp_path, *args)
        assert result.returncode == 2, (address, result)
        assert result.stderr.startswith("moorage csi: --node-address "), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not (tmp_path / "csi.sock").exists()

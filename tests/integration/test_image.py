"""The container image (``make image``): containerd imports it and runs moorage in it.

A containerd of the test's own (root, state and socket in a temporary
directory; nothing of a host containerd is used) imports the OCI archive
with ``ctr images import``, and ``ctr run`` runs the tools every role needs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi import mounts

DEV_PACKAGE_ABSENT = (
    "import importlib.util, moorage.cli as c;"
    "assert importlib.util.find_spec('moorage_dev') is None;"
    "assert not {'dev', 'demo'} & set(c.available_commands());"
    "print('moorage_dev absent')"
)


def image() -> tuple[Path, str]:
    path, ref = os.environ.get("MOORAGE_IMAGE"), os.environ.get("MOORAGE_IMAGE_REF")
    assert path and ref, "MOORAGE_IMAGE is not set: run the tests through make (make test)"
    assert Path(path).is_file(), f"{path} is missing: make image builds it"
    name, _, tag = ref.rpartition(":")
    return Path(path), f"docker.io/library/{name}:{tag}" if "/" not in name else ref


@pytest.fixture(scope="module")
def ctr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    root = tmp_path_factory.mktemp("containerd")
    sock = root / "containerd.sock"
    with (root / "containerd.log").open("wb") as log:
        proc = subprocess.Popen(
            ["containerd", "--root", str(root / "root"), "--state", str(root / "state"),
             "--address", str(sock)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, (root / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.1)
        yield ["ctr", "--address", str(sock)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        for entry in sorted(mounts.mount_entries(), key=lambda e: -len(e.mount_point)):
            if entry.mount_point.startswith(str(root)):
                with contextlib.suppress(mounts.MountError):
                    mounts.unmount(entry.mount_point, lazy=True)


def run(argv: list[str], timeout: float = 300) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_containerd_imports_the_image_and_runs_every_roles_tools(ctr: list[str]) -> None:
    archive, ref = image()
    run([*ctr, "images", "import", str(archive)])
    assert ref in run([*ctr, "images", "ls", "-q"]).split()
    for n, (argv, expect) in enumerate(
        [
            (["moorage", "--help"], "csi"),
            (["moorage", "csi", "serve", "--help"], "--endpoint"),
            (["moorage", "backend", "serve", "--help"], "--metrics-listen"),
            (["ganesha.nfsd", "-v"], "NFS-Ganesha Release = V4"),
            (["nbdinfo", "--version"], "libnbd"),
            (["mkfs.xfs", "-V"], "mkfs.xfs version"),
            (["/opt/moorage/bin/python", "-c", "import pyfuse3, csi.proto.csi_pb2"], ""),
            # the developer's tools (the demo, the dev cluster) are not in the image
            (["/opt/moorage/bin/python", "-c", DEV_PACKAGE_ABSENT], "moorage_dev absent"),
            # rpcbind finds its port by name: without /etc/services it binds nothing
            (["getent", "services", "sunrpc"], "111/tcp"),
            # ganesha's VFS finds the exported filesystems in /etc/mtab
            (["cat", "/etc/mtab"], " /proc proc "),
        ]
    ):
        out = run([*ctr, "run", "--rm", ref, f"moorage-test-{os.getpid()}-{n}", *argv])
        assert expect in out, f"{argv}: {out}"

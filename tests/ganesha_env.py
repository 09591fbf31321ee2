"""A throwaway place for a test's ganesha: shared by the ganesha, FUSE NFS, attach tests
and the attach benchmark.

A directory under /tmp (tmp_path may hold characters the configuration's
allowlist refuses), a tmpfs for the exported directories, a loopback core
configuration on free ports, and the configuration files.  Afterwards no
ganesha started with that configuration is left, the tmpfs is unmounted and
the directory removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from backend.ganesha.config import CoreConfig
from backend.ganesha.files import GaneshaFiles
from tests.conftest import free_port


def ganesha_pids(config_file: Path) -> list[int]:
    """Pids of ganesha processes started with this configuration file."""
    result = subprocess.run(
        ["pgrep", "-f", f"ganesha.nfsd .*-f {config_file}"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return [int(pid) for pid in result.stdout.split()]


@dataclass(frozen=True)
class Workspace:
    base: Path
    exports: Path  # the tmpfs
    core: CoreConfig
    files: GaneshaFiles


@contextmanager
def ganesha_workspace(prefix: str, size: str) -> Iterator[Workspace]:
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    # readable by everyone: mount points live here and non-root test processes walk to them
    base.chmod(0o755)
    exports = base / "exports"
    exports.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(exports)],
        check=True,
        timeout=30,
    )
    files = GaneshaFiles(base / "etc")
    try:
        nfs_port, mount_port = free_port(), free_port()
        while mount_port == nfs_port:
            mount_port = free_port()
        core = CoreConfig(
            nfs_port=nfs_port,
            mount_port=mount_port,
            bind_addr="127.0.0.1",
            recovery_root=base / "recovery",
            graceless=True,
            grace_period=5,
            lease_lifetime=5,
        )
        files.write_main(core)
        yield Workspace(base, exports, core, files)
    finally:
        # ganesha is stopped by whoever started it; if a test broke that, it goes here
        for pid in ganesha_pids(files.main_file):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["umount", str(exports)], check=True, timeout=30)
        shutil.rmtree(base)

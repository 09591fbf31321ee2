"""Running the mount and filesystem tools: argv lists, timeouts, the C locale.

Every tool runs from an argv list (never a shell), with a timeout, in the C
locale, and a failure raises :class:`~csi.mounts.errors.MountError`
carrying the argv, the exit status and the tool's stderr.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from typing import Final

from csi.mounts.errors import MountError

TIMEOUT: Final = 60.0  # mount, umount, blkid
_SBIN_DIRS: Final = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def _tool(name: str) -> str:
    """The tool's path; sbin directories searched too (a non-root PATH often lacks them)."""
    path = os.environ.get("PATH", os.defpath)
    found = shutil.which(name, path=os.pathsep.join([path, *_SBIN_DIRS]))
    return found or name


def run(
    argv: Sequence[str], timeout: float, ok: Iterable[int] = (0,)
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; an exit status outside ``ok``, a timeout or a missing tool → MountError."""
    argv = list(argv)
    env = {**os.environ, "LC_ALL": "C"}
    try:
        result = subprocess.run(
            [_tool(argv[0]), *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        raise MountError(argv, None, f"timed out after {timeout:g}s") from e
    except OSError as e:  # not installed, not executable
        raise MountError(argv, None, f"cannot run {argv[0]}: {e.strerror or e}") from e
    if result.returncode not in set(ok):
        raise MountError(argv, result.returncode, result.stderr or result.stdout)
    return result

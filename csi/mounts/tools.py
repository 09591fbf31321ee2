"""Running the mount and filesystem tools, their failures as :class:`MountError`.

The tools run through :func:`hostio.tools.run` (an argv list, a timeout, the
C locale); a failure raises :class:`~csi.mounts.errors.MountError` carrying
the argv, the exit status and what the tool said.
"""

from __future__ import annotations

import subprocess
from collections.abc import Collection, Sequence
from typing import Final

from csi.mounts.errors import MountError
from hostio import tools

TIMEOUT: Final = 60.0  # mount, umount, blkid


def run(
    argv: Sequence[str], timeout: float, ok: Collection[int] = (0,)
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; an exit status outside ``ok``, a timeout or a missing tool → MountError."""
    try:
        return tools.run(argv, timeout=timeout, ok=ok)
    except tools.ToolError as e:
        raise MountError(e.argv, e.returncode, e.stderr or e.stdout) from e

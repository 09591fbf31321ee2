"""Running external tools on the storage node, their failures as :class:`CommandFailed`.

The tools run through :func:`hostio.tools.run` (an argv list, a timeout, the
C locale, so the English words callers look for in stderr are there).
"""

from __future__ import annotations

from backend.api.errors import CommandFailed
from hostio import tools

# What CommandFailed.returncode says of a tool that did not run or did not finish.
NOT_FINISHED = -1


def run(argv: list[str], timeout: float = 120, input: bytes | None = None) -> str:
    """Run a tool; return its stdout; raise CommandFailed with its stderr."""
    try:
        return tools.run(argv, timeout=timeout, input=input).stdout
    except tools.ToolError as e:
        code = NOT_FINISHED if e.returncode is None else e.returncode
        raise CommandFailed(argv, code, e.stderr) from e

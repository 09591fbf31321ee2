"""Running external tools: argv lists, timeouts, stderr in the error."""

from __future__ import annotations

import logging
import subprocess

from backend.api.errors import CommandFailed

log = logging.getLogger("moorage.backend")


def run(argv: list[str], timeout: float = 120, input: bytes | None = None) -> str:
    """Run a tool; return its stdout; raise CommandFailed with its stderr."""
    log.debug("run %s", argv)
    try:
        result = subprocess.run(
            argv, capture_output=True, timeout=timeout, input=input, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise CommandFailed(argv, -1, f"timed out after {timeout}s") from e
    except FileNotFoundError as e:
        raise CommandFailed(argv, 127, f"{argv[0]} not found") from e
    if result.returncode != 0:
        raise CommandFailed(argv, result.returncode, result.stderr.decode(errors="replace"))
    return result.stdout.decode(errors="replace")

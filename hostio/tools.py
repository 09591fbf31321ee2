"""Running a host tool: an argv list, a timeout, the C locale, stderr in the error.

Every tool runs from an argv list (never a shell), in the C locale
(``LC_ALL=C`` and ``LANG=C``) so that what it prints, and what a caller
looks for in it ("busy", "not mounted"), is the English the code was
written against, whatever the host's locale.  It runs in a session of its
own, so a timeout kills it together with any child it started (a child
holding the output pipes open would otherwise keep the wait going).  A tool
that fails, cannot be started or does not finish in time raises
:class:`ToolError` with the argv, the exit status and what it said; each
layer turns that into an error of its own where it needs one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Collection, Mapping, Sequence
from typing import Final

log = logging.getLogger("moorage.hostio")

# Searched after PATH: a non-root PATH often lacks them, and the tools are there.
SBIN_DIRS: Final = ("/usr/local/sbin", "/usr/sbin", "/sbin")
C_LOCALE: Final = {"LC_ALL": "C", "LANG": "C"}


class ToolError(Exception):
    """A tool failed: its argv, its exit status (None: it did not run or did not
    finish) and what it said (stderr; the reason when it did not run)."""

    def __init__(
        self, argv: Sequence[str], returncode: int | None, stderr: str, stdout: str = ""
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.stdout = stdout.strip()
        status = "did not finish" if returncode is None else f"exited {returncode}"
        said = self.stderr or self.stdout or "(no output)"
        super().__init__(f"{shlex.join(self.argv)} {status}: {said}")


class ToolTimedOut(ToolError):
    """The tool was still running at its timeout, and was killed."""


def tool_path(name: str) -> str:
    """The executable ``name`` names: PATH first, then the sbin directories."""
    path = os.environ.get("PATH", os.defpath)
    return shutil.which(name, path=os.pathsep.join([path, *SBIN_DIRS])) or name


def tool_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment in the C locale (plus ``extra``), for a tool."""
    return {**os.environ, **C_LOCALE, **(extra or {})}


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    input: bytes | None = None,
    ok: Collection[int] = (0,),
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end within ``timeout`` seconds; its output as text.

    An exit status outside ``ok`` raises :class:`ToolError`, and so does a
    tool that cannot be run; one still running after ``timeout`` is killed,
    its children with it, and raises :class:`ToolTimedOut`.  ``env`` is added to the environment.
    Output is decoded leniently: a byte that is not UTF-8 becomes U+FFFD.
    """
    argv = list(argv)
    log.debug("run %s", shlex.join(argv))
    try:
        proc = subprocess.Popen(
            [tool_path(argv[0]), *argv[1:]],
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=tool_environment(env),
            start_new_session=True,
        )
    except OSError as e:  # not installed, not executable
        raise ToolError(argv, None, f"cannot run {argv[0]}: {e.strerror or e}") from e
    with proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            _kill_session(proc)
            raise ToolTimedOut(argv, None, f"timed out after {timeout:g}s") from e
        except BaseException:
            _kill_session(proc)
            raise
    stdout = out.decode(errors="replace")
    stderr = err.decode(errors="replace")
    if proc.returncode not in ok:
        raise ToolError(argv, proc.returncode, stderr, stdout)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill the tool and every process of its session, and reap the tool."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    # a daemon that left the session may still hold the pipes: do not wait on it
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)

"""hostio.tools: a host tool runs in the C locale, within its timeout, its stderr in the error."""

from __future__ import annotations

import os
import time

import pytest

from backend.api.errors import CommandFailed
from backend.commands import run as backend_run
from hostio import tools


def test_a_tool_runs_in_the_c_locale_whatever_this_process_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the storage node's old runner passed the host's locale on, and then looked
    # for the English "busy" in umount's stderr
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    monkeypatch.setenv("LANG", "fr_FR.UTF-8")
    result = tools.run(["sh", "-c", 'echo "$LC_ALL $LANG"'], timeout=10)
    assert result.stdout == "C C\n"
    assert backend_run(["sh", "-c", 'echo "$LC_ALL"'], timeout=10) == "C\n"


def test_a_failing_tool_raises_with_its_argv_status_and_stderr() -> None:
    with pytest.raises(tools.ToolError) as caught:
        tools.run(["sh", "-c", "echo out; echo 'it broke' >&2; exit 3"], timeout=10)
    error = caught.value
    assert (error.argv, error.returncode) == (("sh", "-c", error.argv[2]), 3)
    assert (error.stderr, error.stdout) == ("it broke", "out")
    assert str(error).endswith("exited 3: it broke")


def test_the_error_says_what_the_tool_printed_when_it_wrote_no_stderr() -> None:
    with pytest.raises(tools.ToolError, match=r"exited 1: only on stdout$"):
        tools.run(["sh", "-c", "echo only on stdout; exit 1"], timeout=10)


def test_exit_statuses_the_caller_expects_are_no_error() -> None:
    result = tools.run(["sh", "-c", "echo found; exit 2"], timeout=10, ok=(0, 2))
    assert (result.returncode, result.stdout) == (2, "found\n")


def test_a_missing_tool_is_an_error_that_did_not_run() -> None:
    with pytest.raises(tools.ToolError, match="cannot run moorage-no-such-tool") as missing:
        tools.run(["moorage-no-such-tool"], timeout=10)
    assert missing.value.returncode is None
    assert not isinstance(missing.value, tools.ToolTimedOut)


def _running(argv: list[bytes]) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:-1] == argv:
                    return True
        except OSError:
            continue
    return False


def test_a_tool_past_its_timeout_is_killed_with_the_children_holding_its_output() -> None:
    # a child keeping stdout open made the old runners wait for it after the kill
    marker = f"{60 + os.getpid() % 1000 / 1000:.3f}"  # a sleep no other test runs
    started = time.monotonic()
    with pytest.raises(tools.ToolTimedOut, match=r"did not finish: timed out after 0\.5s"):
        tools.run(["sh", "-c", f"sleep {marker} & wait"], timeout=0.5)
    assert time.monotonic() - started < 10
    assert not _running([b"sleep", marker.encode()])


def test_input_is_given_on_stdin_and_output_is_decoded_leniently() -> None:
    result = tools.run(["sh", "-c", "cat; printf '\\377'"], timeout=10, input=b"in\n")
    assert result.stdout == "in\n\ufffd"
    assert tools.run(["sh", "-c", "cat"], timeout=10).stdout == ""  # no input: /dev/null


def test_sbin_tools_are_found_without_sbin_in_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    found = tools.tool_path("losetup")
    assert os.path.isabs(found) and os.path.basename(found) == "losetup"


def test_the_storage_node_turns_a_failure_into_command_failed() -> None:
    with pytest.raises(CommandFailed) as failed:
        backend_run(["sh", "-c", "echo 'target is busy' >&2; exit 32"], timeout=10)
    assert (failed.value.returncode, failed.value.stderr) == (32, "target is busy")
    with pytest.raises(CommandFailed) as slow:
        backend_run(["sleep", "5"], timeout=0.2)
    assert slow.value.returncode == -1 and "timed out" in slow.value.stderr

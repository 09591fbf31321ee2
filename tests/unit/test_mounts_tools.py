"""``csi.mounts.tools``: a failing, missing or hung tool is a MountError; the C locale."""

from __future__ import annotations

import pytest

from csi.mounts import MountError, tools


def test_a_failing_tool_raises_with_its_argv_status_and_stderr() -> None:
    with pytest.raises(MountError) as caught:
        tools.run(["sh", "-c", "echo 'it broke' >&2; exit 3"], timeout=10)
    error = caught.value
    assert (error.returncode, error.stderr) == (3, "it broke")
    assert error.argv[0] == "sh"
    assert "exited 3: it broke" in str(error)


def test_a_missing_tool_and_a_hung_tool_are_mount_errors() -> None:
    with pytest.raises(MountError, match="cannot run") as missing:
        tools.run(["moorage-no-such-tool"], timeout=10)
    assert missing.value.returncode is None
    with pytest.raises(MountError, match=r"timed out after 0\.2s"):
        tools.run(["sleep", "5"], timeout=0.2)


def test_the_tools_run_in_the_c_locale() -> None:
    result = tools.run(["sh", "-c", 'echo "$LC_ALL"'], timeout=10)
    assert result.stdout.strip() == "C"

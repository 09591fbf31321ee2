"""``csi.mounts.validation``: mount options from an allowlist, one at a time."""

from __future__ import annotations

import pytest

from csi import mounts
from csi.mounts import MountOptionError


@pytest.mark.parametrize(
    "option",
    [
        "rw,exec\n",
        "rw,exec",
        "ro\nrw",
        "a b",
        "",
        "-o",
        'context="x"',
        "x\\y",
        "uid=0\0",
        "é",
        "x" * 300,
    ],
)
def test_mount_options_outside_the_allowlist_are_refused(option: str) -> None:
    with pytest.raises(MountOptionError):
        mounts.validate_options([option])


def test_a_comma_joined_string_of_options_is_refused() -> None:
    with pytest.raises(MountOptionError, match="list of options"):
        mounts.validate_options("rw,noexec")


def test_ordinary_mount_options_pass() -> None:
    options = ["ro", "port=2049", "vers=4.1", "addr=fe80::1", "sec=sys", "uid=1000", "x-gvfs"]
    assert mounts.validate_options(options) == tuple(options)

"""Fixtures of the integration tests: loop devices and directories for ``csi.mounts``.

Runs as root.  Every loop device and mount a test makes is recorded by the
``disks`` fixture, whose teardown unmounts (lazily if busy) everything mounted
under the test's directory and detaches its loop devices, whether the test
passed or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from csi import mounts
from tests.disks import Disks


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[Disks]:
    d = Disks(tmp_path)
    try:
        yield d
    finally:
        d.cleanup()
        leftover = [e.mount_point for e in mounts.mount_entries() if str(d.base) in e.mount_point]
        assert leftover == [], f"teardown left mounts: {leftover}"

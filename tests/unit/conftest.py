"""Fixtures of the unit tests: a fake mount table and recorded tools for ``csi.mounts``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from csi.mounts import table, tools


@pytest.fixture
def mountinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake /proc/self/mountinfo the module reads instead of the real one."""
    fake = tmp_path / "mountinfo"
    fake.write_text("")
    monkeypatch.setattr(table, "MOUNTINFO", fake)
    return fake


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every tool the module would run, recorded instead of run."""
    recorded: list[list[str]] = []

    def fake_run(argv: Sequence[str], timeout: float, ok: Sequence[int] = (0,)) -> object:
        recorded.append(list(argv))
        return None

    monkeypatch.setattr(tools, "run", fake_run)
    return recorded

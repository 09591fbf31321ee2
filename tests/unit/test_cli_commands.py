"""The ``moorage`` command set: the developer's commands only where their package is."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from moorage import cli


def test_a_source_checkout_has_the_developers_commands() -> None:
    assert {"dev", "demo"} <= set(cli.available_commands())
    result = CliRunner().invoke(cli.build_app(), ["dev", "--help"])
    assert result.exit_code == 0, result.output
    assert "cluster" in result.output


def test_without_moorage_dev_the_developers_commands_are_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name == cli.DEV_PACKAGE else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    commands = cli.available_commands()
    assert not {"dev", "demo"} & set(commands)
    assert {"nbd", "backend", "csi", "attach"} <= set(commands)
    result = CliRunner().invoke(cli.build_app(), ["dev", "--help"])
    assert result.exit_code != 0
    assert "No such command" in result.output

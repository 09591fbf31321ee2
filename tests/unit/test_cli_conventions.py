"""The conventions every ``moorage`` command shares (moorage/output.py, docs/cli.md):
help without Python types, errors on one line, exceptions from trio's nurseries
unwrapped, and the message for a storage node that is not there."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import trio
import typer

from moorage.admin_cmd import unreachable
from moorage.cli import command
from moorage.output import CANNOT_START, FAILED, first_line, leaves, run_service
from tests.fake_rpc import FakeRpcError

TYPE_NOISE = re.compile(r"<(str|bool|int|float|path|list\[[a-z]+\]|[a-z]+\|[a-z|]+)>")


def every_command(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, group
    for name, sub in getattr(group, "commands", {}).items():
        yield from every_command(sub, (*path, name))


def help_of(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        command()([*path, "--help"], prog_name="moorage")
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_help_page_names_values_not_python_types(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    pages = list(every_command(command()))
    assert len(pages) > 30  # the whole tree, groups and commands
    for path, cmd in pages:
        text = help_of(path, capsys)
        assert not TYPE_NOISE.search(text), (path, TYPE_NOISE.search(text), text)
        for param in cmd.params:
            if getattr(param, "is_flag", False) or not param.opts[0].startswith("-"):
                continue
            # a value option shows what to put after it: --size SIZE
            assert f" {param.metavar}" in text and param.metavar, (path, param.opts, text)


def test_an_argument_is_shown_by_its_name_in_the_usage_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = help_of(("volume", "create"), capsys)
    assert "Usage: moorage volume create [OPTIONS] NAME" in text
    assert "--size" in text and "SIZE" in text
    assert "{name}" not in text


def test_brackets_in_a_help_text_are_shown_as_written(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    serve = help_of(("backend", "serve"), capsys)
    assert "unix:PATH [unix:DATA_DIR/backend.sock] or HOST:PORT" in serve
    plugin = help_of(("csi", "serve"), capsys)
    assert "see this node as [the configuration's node.address]" in plugin


def test_nothing_answering_is_told_with_the_address_and_how_to_start_one() -> None:
    gone = FakeRpcError(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
        "Failed to connect to remote host: Connection refused",
    )
    message = unreachable("127.0.0.1:1", gone)
    assert message is not None
    assert "no storage node answered at 127.0.0.1:1 (Connection refused)" in message
    assert "moorage backend serve" in message and "MOORAGE_BACKEND" in message


def test_a_storage_node_that_answers_unavailable_is_not_called_unreachable() -> None:
    busy = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "storage node sn-b does not answer")
    assert unreachable("127.0.0.1:9", busy) is None
    refused = FakeRpcError(grpc.StatusCode.NOT_FOUND, "failed to connect to all addresses")
    assert unreachable("127.0.0.1:9", refused) is None


def test_leaves_unwrap_nested_groups() -> None:
    inner = OSError(98, "cannot listen on 127.0.0.1:1: Address already in use")
    group = ExceptionGroup("outer", [ExceptionGroup("inner", [inner]), ValueError("x")])
    assert list(leaves(group)) == [inner, group.exceptions[1]]
    assert first_line(inner) == "cannot listen on 127.0.0.1:1: Address already in use"
    assert first_line(RuntimeError("first\nsecond")) == "first"


async def _fails_in_a_nursery(error: BaseException) -> None:
    async def raise_it() -> None:
        raise error

    async with trio.open_nursery() as nursery:
        nursery.start_soon(raise_it)


def test_an_expected_start_failure_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = OSError(98, "cannot listen on 127.0.0.1:1: Address already in use")
    with pytest.raises(typer.Exit) as done:
        run_service(
            "x serve", _fails_in_a_nursery, error, expected=(OSError,), started=lambda: False
        )
    assert done.value.exit_code == CANNOT_START
    err = capsys.readouterr().err
    assert err == "moorage x serve: cannot listen on 127.0.0.1:1: Address already in use\n"


def test_the_same_failure_after_start_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as done:
        run_service(
            "x serve",
            _fails_in_a_nursery,
            OSError("gone"),
            expected=(OSError,),
            started=lambda: True,
        )
    assert done.value.exit_code == FAILED
    assert capsys.readouterr().err == "moorage x serve: gone\n"


def test_an_unexpected_error_keeps_its_traceback() -> None:
    with pytest.raises(ExceptionGroup) as raised:
        run_service(
            "x serve",
            _fails_in_a_nursery,
            KeyError("bug"),
            expected=(OSError,),
            started=lambda: False,
        )
    assert isinstance(raised.value.exceptions[0], KeyError)

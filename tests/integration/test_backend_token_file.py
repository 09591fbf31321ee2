"""A token file its group or others may read: the storage node refuses it, clients warn.

``backend serve --token-file`` exits 2 with one line saying which file, its
mode and how to fix it, unless ``--allow-shared-token-file``; the admin CLI
and the CSI plugin (BackendClient) only warn.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.api.auth import read_token
from backend.api.client import BackendClient
from tests.backend_node import BackendNode, make_node
from tests.conftest import REPO, free_port

TOKEN = "0123456789abcdef-shared-token"


def token_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "moorage", "backend", "serve",
            "--data-dir", str(tmp_path / "data"), "--pool", str(tmp_path / "pool"),
            "--nbd-listen", f"127.0.0.1:{free_port()}",
            "--nfs-port", str(free_port()), "--mount-port", str(free_port()), "--graceless",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, COLUMNS="200"),
        timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_serve_refuses_a_token_file_others_may_read(tmp_path: Path, mode: int) -> None:
    token = token_file(tmp_path, mode)
    result = serve(tmp_path, "--token-file", str(token))
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        f"moorage backend serve: token file {token} has mode {mode:04o} (its group or others "
        f"may read it): chmod 600 {token}, or pass --allow-shared-token-file"
    ]
    assert not (tmp_path / "data").exists(), "refused after it had begun"


def test_serve_refuses_it_on_tcp_too(tmp_path: Path) -> None:
    token = token_file(tmp_path, 0o644)
    result = serve(tmp_path, "--token-file", str(token), "--listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2, result
    [line] = result.stderr.splitlines()
    assert f"token file {token} has mode 0644" in line


@pytest.fixture
def shared_node(tmp_path: Path) -> Iterator[BackendNode]:
    node = make_node(tmp_path / "node", extra_args=["--allow-shared-token-file"])
    node.listen = f"127.0.0.1:{free_port()}"
    node.token_file = token_file(tmp_path, 0o644)
    try:
        node.start()
        yield node
    finally:
        node.teardown()


def test_allow_shared_token_file_starts_and_warns(
    shared_node: BackendNode, caplog: pytest.LogCaptureFixture
) -> None:
    token = shared_node.token_file
    assert token is not None
    assert f"token file {token} has mode 0644" in shared_node.log.read_text()
    # a client only warns (once per file: the fixture's client was warned already)
    copy = token.with_name("client-token")
    copy.write_text(token.read_text())
    copy.chmod(0o640)
    with (
        caplog.at_level(logging.WARNING, logger="moorage.backend.auth"),
        BackendClient(shared_node.address, token_file=copy, timeout=30) as c,
    ):
        assert c.health().ganesha_running
    assert any(f"token file {copy} has mode 0640" in r.getMessage() for r in caplog.records)
    # and so does the admin CLI, which then does its job
    result = shared_node.cli("pool", "--token-file", str(token), "status")
    assert f"token file {token} has mode 0644" in result.stderr
    assert "chmod 600" in result.stderr


def test_a_private_token_file_is_taken_without_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = token_file(tmp_path, 0o600)
    with caplog.at_level(logging.WARNING, logger="moorage.backend.auth"):
        assert read_token(token, refuse_shared=True) == TOKEN
        with BackendClient("127.0.0.1:1", token_file=token, timeout=1):
            pass
    assert not caplog.records

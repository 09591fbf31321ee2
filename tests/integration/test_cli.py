"""The command line's conventions on real processes (docs/cli.md): exit codes,
one-line errors on stderr, ``--json`` on stdout, a storage node that is not
there, and daemons that cannot start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.poolinit import init_loop_pool, release_loop_pool
from tests.backend_node import BackendNode, backend_node  # noqa: F401
from tests.conftest import REPO, free_port

MiB = 1 << 20


def moorage(*args: str, backend: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")
    if backend is not None:
        env["MOORAGE_BACKEND"] = backend
    return subprocess.run(
        [sys.executable, "-m", "moorage", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


def error_lines(result: subprocess.CompletedProcess[str], command: str) -> list[str]:
    """The lines of stderr that are the command's own errors (not log lines)."""
    return [line for line in result.stderr.splitlines() if line.startswith(f"moorage {command}:")]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# ------------------------------------------------------ no storage node there


def test_no_storage_node_at_a_socket_path_is_exit_3_naming_the_address(tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/backend.sock"
    for args in (("volume", "list"), ("volume", "list", "--json"), ("pool", "status")):
        result = moorage(*args, backend=address)
        assert result.returncode == 3, result
        assert result.stdout == "", result
        [line] = error_lines(result, " ".join(args[:2]))
        assert f"no storage node answered at {address} (No such file or directory)" in line
        assert "moorage backend serve" in line and "MOORAGE_BACKEND" in line


def test_no_storage_node_at_a_tcp_address_is_exit_3(taken_port: int) -> None:
    closed = free_port()
    result = moorage("volume", "get", "x", backend=f"127.0.0.1:{closed}")
    assert result.returncode == 3, result
    [line] = error_lines(result, "volume get")
    assert f"at 127.0.0.1:{closed} (Connection refused)" in line


# ------------------------------------------------------------ --json, codes


def test_every_admin_command_prints_one_json_document(node: BackendNode) -> None:
    def json_of(*args: str) -> Any:
        result = node.cli(*args, "--json")
        assert result.stderr == "", result
        return json.loads(result.stdout)  # one document, nothing else on stdout

    made = json_of("volume", "create", "cli-json", "--size", "8M")
    # protobuf's JSON mapping: 64-bit integers are strings
    assert isinstance(made, dict) and made["name"] == "cli-json" and made["size_bytes"] == "8388608"
    assert json_of("volume", "get", "cli-json")["id"] == made["id"]
    listed = json_of("volume", "list")
    assert isinstance(listed, list) and [v["id"] for v in listed] == [made["id"]]
    grown = json_of("volume", "expand", "cli-json", "--size", "16M")
    assert grown["size_bytes"] == str(16 * MiB)
    target = json_of("volume", "publish", "cli-json", "--node", "n1", "--address", "127.0.0.1")
    assert target["nbd"]["export_name"] == f"{made['id']}@n1"
    undone = json_of("volume", "unpublish", "cli-json", "--node", "n1")
    assert undone == {"id": made["id"], "name": "cli-json", "node_id": "n1", "unpublished": True}
    snap = json_of("snapshot", "create", "cli-snap", "--volume", "cli-json")
    assert snap["source_volume_id"] == made["id"]
    assert [s["id"] for s in json_of("snapshot", "list")] == [snap["id"]]
    assert json_of("snapshot", "delete", snap["id"]) == {"id": snap["id"], "deleted": True}
    status = json_of("pool", "status")
    assert set(status) == {"capacity", "health"}
    gone = json_of("volume", "delete", "cli-json")
    assert gone == {"id": made["id"], "name": "cli-json", "deleted": True}
    assert json_of("volume", "list") == []


@pytest.fixture
def node(backend_node: BackendNode) -> BackendNode:  # noqa: F811
    return backend_node


def test_a_refused_operation_is_exit_1_with_the_status_on_stderr(node: BackendNode) -> None:
    node.cli("volume", "create", "held", "--size", "8M")
    node.cli("volume", "publish", "held", "--node", "n1", "--address", "127.0.0.1")
    refused = node.cli("volume", "delete", "held", "--json", check=False)
    assert refused.returncode == 1, refused
    assert refused.stdout == ""
    [line] = error_lines(refused, "volume delete")
    assert "FAILED_PRECONDITION" in line and "published to n1" in line
    bad = node.cli("volume", "create", "x", "--size", "lots", check=False)
    assert bad.returncode == 2 and "lots" in bad.stderr, bad  # usage: nothing was asked


# ------------------------------------------------------- daemons that cannot start


def test_nbd_serve_on_a_taken_port_says_so_in_one_line(tmp_path: Path, taken_port: int) -> None:
    image = tmp_path / "disk.img"
    image.write_bytes(b"\0" * MiB)
    result = moorage("nbd", "serve", "--listen", f"127.0.0.1:{taken_port}", "-e", f"d={image}")
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert error_lines(result, "nbd serve") == [
        f"moorage nbd serve: cannot listen on 127.0.0.1:{taken_port}: Address already in use"
    ]


def serve_args(node_root: Path, *extra: str) -> list[str]:
    return [
        "backend",
        "serve",
        "--data-dir",
        str(node_root / "data"),
        "--pool",
        str(node_root / "pool"),
        "--nfs-port",
        str(free_port()),
        "--mount-port",
        str(free_port()),
        "--graceless",
        *extra,
    ]


def test_backend_serve_with_its_nbd_port_taken(tmp_path: Path, taken_port: int) -> None:
    result = moorage(*serve_args(tmp_path, "--nbd-listen", f"127.0.0.1:{taken_port}"))
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert error_lines(result, "backend serve") == [
        f"moorage backend serve: cannot listen on 127.0.0.1:{taken_port}: Address already in use"
    ]


def test_backend_serve_with_its_api_port_taken(tmp_path: Path, taken_port: int) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    args = ["--nbd-listen", f"127.0.0.1:{free_port()}", "--token-file", str(token)]
    result = moorage(*serve_args(tmp_path, *args, "--listen", f"127.0.0.1:{taken_port}"))
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    [line] = error_lines(result, "backend serve")
    assert f"cannot serve the API on 127.0.0.1:{taken_port}" in line


def test_backend_serve_with_its_pool_image_gone(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    image = init_loop_pool(pool, 300 * MiB)
    release_loop_pool(pool)
    image.unlink()
    result = moorage(*serve_args(tmp_path, "--nbd-listen", f"127.0.0.1:{free_port()}"))
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert error_lines(result, "backend serve") == [
        f"moorage backend serve: pool image {image} of {pool} is missing"
    ]

"""What the storage-node tests do against a running node: create volumes through its API,
expect a call to fail with a given status, run a data-path client tool, make a large
file of random bytes, and look at the pool's images."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as pb
from tests.backend_node import BackendNode

MiB = 1 << 20


def rpc_error(fn: Callable[..., object], *args: Any, **kwargs: Any) -> grpc.Call:
    """Call ``fn(*args, **kwargs)``, which must fail with a gRPC status; return the error."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return cast(grpc.Call, info.value)


def expect(code: grpc.StatusCode, fn: Callable[..., object], *args: Any, **kwargs: Any) -> str:
    """``fn(*args, **kwargs)`` fails with ``code``; returns the status details."""
    err = rpc_error(fn, *args, **kwargs)
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    return err.details() or ""


def tool(
    *argv: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    """Run a client tool; output as bytes (nfs-cat prints file contents)."""
    result = subprocess.run(list(argv), capture_output=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{list(argv)} exited {result.returncode}\nstdout: {result.stdout[-2000:]!r}\n"
            f"stderr: {result.stderr[-2000:]!r}"
        )
    return result


def big_random_file(path: Path, size: int) -> str:
    """A file of ``size`` random bytes, written in chunks; returns its sha256."""
    digest = hashlib.sha256()
    chunk = os.urandom(4 * MiB)
    with path.open("wb") as f:
        left = size
        while left:
            piece = chunk[: min(left, len(chunk))]
            # vary the chunks so equal blocks cannot hide misplaced ones
            piece = left.to_bytes(8, "little") + piece[8:]
            f.write(piece)
            digest.update(piece)
            left -= len(piece)
    return digest.hexdigest()


def nbd_uri(target: pb.PublishVolumeResponse) -> str:
    assert target.WhichOneof("target") == "nbd"
    return f"nbd://{target.nbd.host}:{target.nbd.port}/{target.nbd.export_name}"


def _create(
    c: BackendClient, req: pb.CreateVolumeRequest, snapshot_id: str, volume_id: str
) -> pb.Volume:
    if snapshot_id:
        req.snapshot_id = snapshot_id
    if volume_id:
        req.volume_id = volume_id
    return c.create_volume(req)


def nbd_volume(
    c: BackendClient, name: str, size: int, snapshot_id: str = "", volume_id: str = ""
) -> pb.Volume:
    req = pb.CreateVolumeRequest(name=name, type=pb.NBD, size_bytes=size)
    return _create(c, req, snapshot_id, volume_id)


def nfs_volume(
    c: BackendClient,
    name: str,
    size: int,
    fs_type: str = "xfs",
    snapshot_id: str = "",
    volume_id: str = "",
) -> pb.Volume:
    req = pb.CreateVolumeRequest(
        name=name, type=pb.NFS, size_bytes=size, parameters={"fs_type": fs_type}
    )
    return _create(c, req, snapshot_id, volume_id)


def pool_images(node: BackendNode, kind: str = "volumes") -> set[str]:
    folder = node.pool_dir / kind
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()

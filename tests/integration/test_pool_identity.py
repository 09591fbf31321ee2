"""A catalog that is not the pool's never costs a volume (issue 17, item 1).

A real ``moorage backend serve`` on a loop pool: a catalog restored from an
older backup makes the next start quarantine the volumes made since (moved,
whole, to ``POOL/quarantine``), which ``moorage volume adopt`` records again
with their data; an empty catalog, or one that belongs to another pool, is
refused at start (exit 2, one line) until the operator passes
``--claim-pool``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as pb
from backend.poolidentity import read_pool_id, write_pool_id
from tests.backend_node import BackendNode, make_node

MiB = 1 << 20
CATALOG_FILES = ("catalog.sqlite3", "catalog.sqlite3-wal", "catalog.sqlite3-shm")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[BackendNode]:
    node = make_node(tmp_path / "node")
    try:
        yield node
    finally:
        node.teardown()


def copy_catalog(src: Path, dst: Path) -> None:
    """The SQLite catalog's files (taken while the daemon is stopped)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in CATALOG_FILES:
        (dst / name).unlink(missing_ok=True)
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def remove_catalog(data_dir: Path) -> None:
    for name in CATALOG_FILES:
        (data_dir / name).unlink(missing_ok=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused_start(node: BackendNode) -> str:
    """Start the daemon, which must exit 2 at once; returns its last log lines."""
    with pytest.raises(RuntimeError, match="daemon exited 2"):
        node.start(timeout=60)
    return node.log_tail(5)


def create(node: BackendNode, name: str, kind: str, size: int) -> pb.Volume:
    args = ["volume", "create", name, "--type", kind, "--size", f"{size // MiB}M", "--json"]
    return pb.Volume(id=json.loads(node.cli(*args).stdout)["id"])


def test_a_restored_catalog_quarantines_newer_volumes_and_adopt_brings_them_back(
    node: BackendNode,
) -> None:
    pool = node.pool_dir.resolve()
    node.start()
    kept = create(node, "kept", "nbd", 16 * MiB)
    node.stop()
    backup = node.root / "backup"
    copy_catalog(node.data_dir, backup)

    # volumes made after the backup, with data in them
    node.start()
    fs_vol = create(node, "made-later-fs", "nfs", 300 * MiB)
    blk_vol = create(node, "made-later-blk", "nbd", 16 * MiB)
    (pool / "mnt" / fs_vol.id / "export" / "data.bin").write_bytes(os.urandom(3 * MiB))
    fd = os.open(pool / "volumes" / f"{blk_vol.id}.img", os.O_WRONLY)
    try:
        os.pwrite(fd, os.urandom(2 * MiB), 5 * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    fs_sum = sha256(pool / "mnt" / fs_vol.id / "export" / "data.bin")
    blk_sum = sha256(pool / "volumes" / f"{blk_vol.id}.img")
    node.stop()

    # the older catalog comes back: the newer volumes are unknown to it
    copy_catalog(backup, node.data_dir)
    node.start()
    listed = json.loads(node.cli("volume", "list", "--json").stdout)
    assert [v["name"] for v in listed] == ["kept"]
    orphans = json.loads(node.cli("pool", "orphans", "--json").stdout)
    by_id = {o["original_id"]: o for o in orphans}
    assert set(by_id) == {fs_vol.id, blk_vol.id}
    assert by_id[fs_vol.id]["fs_type"] == "xfs"
    assert by_id[blk_vol.id]["size_bytes"] == str(16 * MiB)  # uint64 as JSON text
    assert not (pool / "mnt" / fs_vol.id).exists(), "the unknown volume is still mounted"
    with node.client() as c:
        health = c.health()
    assert "quarantine" in health.message, health

    # adopted back under their names: same ids, same data
    fs_json = node.cli("volume", "adopt", by_id[fs_vol.id]["name"], "--name", "made-later-fs")
    assert fs_json.returncode == 0
    blk = json.loads(
        node.cli(
            "volume", "adopt", by_id[blk_vol.id]["name"], "--name", "made-later-blk", "--json"
        ).stdout
    )
    assert blk["id"] == blk_vol.id and blk["type"] == "NBD" and blk["state"] == "ready"
    with node.client() as c:
        fs = c.get_volume(name="made-later-fs")
        assert (fs.id, fs.type, fs.fs_type, fs.state) == (fs_vol.id, pb.NFS, "xfs", "ready")
        c.publish(fs.id, "node-a", "127.0.0.1")  # it is exportable again
        c.unpublish(fs.id, "node-a")
    assert sha256(pool / "mnt" / fs_vol.id / "export" / "data.bin") == fs_sum
    assert sha256(pool / "volumes" / f"{blk_vol.id}.img") == blk_sum
    assert json.loads(node.cli("pool", "orphans", "--json").stdout) == []

    # adopting twice, or a name in use, is refused and changes nothing
    again = node.cli("volume", "adopt", by_id[fs_vol.id]["name"], "--name", "x", check=False)
    assert again.returncode != 0 and "NOT_FOUND" in again.stderr
    node.stop()
    node.start()  # and the node starts clean on what adopt recorded
    names = {v["name"] for v in json.loads(node.cli("volume", "list", "--json").stdout)}
    assert names == {"kept", "made-later-fs", "made-later-blk"}
    assert json.loads(node.cli("pool", "orphans", "--json").stdout) == []
    node.cli("volume", "delete", kept.id)


def test_an_empty_or_foreign_catalog_is_refused_until_claimed(node: BackendNode) -> None:
    pool = node.pool_dir.resolve()
    node.start()
    vol = create(node, "precious", "nbd", 16 * MiB)
    pool_id = read_pool_id(pool)
    assert pool_id is not None
    node.stop()

    # an empty catalog (lost, or on the wrong path): refused, nothing touched
    saved = node.root / "saved"
    copy_catalog(node.data_dir, saved)
    remove_catalog(node.data_dir)
    line = refused_start(node)
    assert "catalog is new or empty" in line and "--claim-pool" in line, line
    assert (pool / "volumes" / f"{vol.id}.img").exists()
    assert not (pool / "quarantine").exists()

    # the pool is another one's: refused
    copy_catalog(saved, node.data_dir)
    write_pool_id(pool, "f" * 32)
    line = refused_start(node)
    assert f"belongs to pool {pool_id}" in line, line
    write_pool_id(pool, pool_id)
    node.start()
    assert json.loads(node.cli("volume", "get", vol.id, "--json").stdout)["name"] == "precious"
    node.stop()

    # the operator says so: the empty catalog takes the pool, the image is quarantined
    remove_catalog(node.data_dir)
    node.extra_args.append("--claim-pool")
    node.start()
    node.extra_args.remove("--claim-pool")
    assert json.loads(node.cli("volume", "list", "--json").stdout) == []
    [orphan] = json.loads(node.cli("pool", "orphans", "--json").stdout)
    assert orphan["original_id"] == vol.id
    refused = node.cli("pool", "purge-orphan", orphan["name"], check=False)
    assert refused.returncode != 0 and "--yes" in refused.stderr
    assert (pool / "quarantine" / orphan["name"]).exists()
    node.cli("pool", "purge-orphan", orphan["name"], "--yes")
    assert not (pool / "quarantine" / orphan["name"]).exists()
    node.stop()
    node.start()  # paired now: no flag needed

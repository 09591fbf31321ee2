"""Finding the controller's volumes and snapshots on the storage nodes.

By id (a missing one is None, not an error), by name across every storage
node, and a page of one storage node's snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping

from backend.api.proto import backend_pb2 as bpb
from csi.errors import NotFound
from csi.ids import ObjectRef
from csi.storagenodes import StorageNodes


def find_volume(
    nodes: StorageNodes, ref: ObjectRef, secrets: Mapping[str, str] | None = None
) -> bpb.Volume | None:
    try:
        v: bpb.Volume = nodes.call(
            ref.storage_node, lambda c: c.get_volume(volume_id=ref.backend_id), secrets
        )
        return v
    except NotFound:
        return None


def volume_named(
    nodes: StorageNodes, name: str, secrets: Mapping[str, str]
) -> tuple[str, bpb.Volume] | None:
    """The volume of that name on any storage node.  Every storage node is
    asked: one that cannot answer might hold it, so that is UNAVAILABLE
    rather than a risk of two volumes for one name."""
    for node in nodes.names:
        try:
            v = nodes.call(node, lambda c: c.get_volume(name=name), secrets)
        except NotFound:
            continue
        return node, v
    return None


def find_snapshot(
    nodes: StorageNodes, ref: ObjectRef, secrets: Mapping[str, str] | None = None
) -> bpb.Snapshot | None:
    r = nodes.call(
        ref.storage_node, lambda c: c.list_snapshots(snapshot_id=ref.backend_id), secrets
    )
    return r.snapshots[0] if r.snapshots else None


def snapshots_page(
    nodes: StorageNodes, node: str, limit: int, token: str, source: str = ""
) -> tuple[list[bpb.Snapshot], str]:
    r = nodes.call(node, lambda c: c.list_snapshots(limit, token, source_volume_id=source))
    return list(r.snapshots), r.next_token

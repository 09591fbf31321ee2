"""Storage-node objects as CSI messages, and the contexts handed to the node plugin.

``volume_context`` (set at CreateVolume, given back at every node call):
``type`` (nbd|nfs), ``storageNode``, ``nfsFsType`` for nfs volumes,
``fsType`` for nbd volumes whose StorageClass named one, and ``ioTimeout``
when the StorageClass named one.

``publish_context`` (from ControllerPublishVolume to the node's stage call):

- nbd: ``type=nbd``, ``host``, ``port``, ``exportName``, ``tls`` (true|false)
- nfs: ``type=nfs``, ``server``, ``port``, ``exportPath``, ``mountPort`` (NFSv3 MOUNT)
- a static PV of an NFS share outside moorage: ``type=nfs-external``,
  ``server``, ``exportPath``
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import timestamp_pb2, wrappers_pb2

from backend.api.proto import backend_pb2 as bpb
from csi.errors import InvalidArgument
from csi.proto import csi_pb2 as pb

VOLUME_TYPES = {bpb.NBD: "nbd", bpb.NFS: "nfs"}
# An nbd volume's StorageClass fsType, kept with the volume on the storage node.
FS_TYPE_LABEL = "csi.moorage.dev/fs-type"
# A StorageClass's ioTimeout, kept the same way.
IO_TIMEOUT_LABEL = "csi.moorage.dev/io-timeout"
BACKEND_TYPES = {"nbd": bpb.NBD, "nfs": bpb.NFS}


def volume(node: str, v: bpb.Volume, accessible: list[pb.Topology]) -> pb.Volume:
    kind = VOLUME_TYPES[v.type]
    context = {"type": kind, "storageNode": node}
    if kind == "nfs":
        context["nfsFsType"] = v.fs_type
    elif v.labels.get(FS_TYPE_LABEL):
        context["fsType"] = v.labels[FS_TYPE_LABEL]
    if v.labels.get(IO_TIMEOUT_LABEL):
        context["ioTimeout"] = v.labels[IO_TIMEOUT_LABEL]
    source = None
    if v.source_snapshot_id:
        source = pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(
                snapshot_id=f"{node}:{v.source_snapshot_id}"
            )
        )
    elif v.source_volume_id:
        source = pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=f"{node}:{v.source_volume_id}")
        )
    return pb.Volume(
        volume_id=f"{node}:{v.id}",
        capacity_bytes=v.size_bytes,
        volume_context=context,
        content_source=source,
        accessible_topology=accessible,
    )


def condition(v: bpb.Volume, node_problem: str | None = None) -> pb.VolumeCondition:
    """The volume's state; abnormal too while its storage node was last seen down
    (``node_problem``, from the background health checks)."""
    if node_problem is not None:
        return pb.VolumeCondition(abnormal=True, message=f"volume is {v.state}; {node_problem}")
    if v.state in ("ready", "expanding"):
        return pb.VolumeCondition(abnormal=False, message=f"volume is {v.state}")
    return pb.VolumeCondition(
        abnormal=True, message=f"volume is {v.state} on its storage node, not ready"
    )


def published_node_ids(v: bpb.Volume) -> list[str]:
    """The node ids as the node plugins report them (``NAME@ADDRESS``)."""
    return [f"{p.node_id}@{p.node_address}" for p in v.publications]


def snapshot(node: str, s: bpb.Snapshot) -> pb.Snapshot:
    return pb.Snapshot(
        size_bytes=s.size_bytes,
        snapshot_id=f"{node}:{s.id}",
        source_volume_id=f"{node}:{s.source_volume_id}",
        creation_time=timestamp_pb2.Timestamp(seconds=s.created_unix),
        ready_to_use=s.ready_to_use,
        group_snapshot_id=f"{node}:{s.group_snapshot_id}" if s.group_snapshot_id else "",
    )


def int64(value: int) -> wrappers_pb2.Int64Value:
    return wrappers_pb2.Int64Value(value=value)


def external_share(context: Mapping[str, str]) -> dict[str, str] | None:
    """A static PV naming an NFS share outside moorage (``server`` and ``share``
    in its volumeAttributes, as for nfs.csi.k8s.io): nothing to publish."""
    if "server" not in context and "share" not in context:
        return None
    server, share = context.get("server", ""), context.get("share", "")
    if not server or not share.startswith("/"):
        raise InvalidArgument(
            "an external NFS share needs volumeAttributes server and share (an absolute path)"
        )
    return {"type": "nfs-external", "server": server, "exportPath": share}


def publish_context(target: bpb.PublishVolumeResponse) -> dict[str, str]:
    if target.WhichOneof("target") == "nbd":
        t = target.nbd
        return {
            "type": "nbd",
            "host": t.host,
            "port": str(t.port),
            "exportName": t.export_name,
            "tls": "true" if t.tls else "false",
        }
    n = target.nfs
    return {
        "type": "nfs",
        "server": n.server,
        "port": str(n.port),
        "exportPath": n.export_path,
        "mountPort": str(n.mount_port),
    }

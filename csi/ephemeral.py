"""Ephemeral inline volumes: made for one pod at NodePublishVolume, gone at unpublish.

A pod names the volume's attributes in its spec (``csi.volumeAttributes``):

=================  =========================================================
``type``           ``nbd`` (default) or ``nfs``
``size``           a Kubernetes quantity of bytes: ``64Mi``, ``1Gi``, ``1G`` (10^9)
                   (default 1Gi)
``fsType``         nbd: ``ext4`` (default) or ``xfs``
``nfsFsType``      nfs: the volume's own filesystem, ``xfs`` (default) or ``ext4``
``squash``, ``iopsLimit``, ``bandwidthLimit``   as in a StorageClass
``storageNode``    a configured storage node (default: the first the node's
                   topology allows that has room)
=================  =========================================================

The node plugin creates the volume on a storage node of its configuration,
publishes it to itself, and mounts it straight at the pod's target (there is
no staging for ephemeral volumes).  Its name on the storage node is derived
from the volume id kubelet gives (``eph-<digest>``), so every retry finds
the same volume, and the node state records it before it is created: a
plugin that crashes half way finishes the publish or the teardown when
kubelet calls again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from backend.api.proto import backend_pb2 as bpb
from csi import parameters, topology
from csi.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from csi.ids import NodeRef
from csi.messages import BACKEND_TYPES, publish_context
from csi.proto import csi_pb2 as pb
from csi.requests import requested_size
from csi.storagenodes import StorageNodes
from hostio.sizes import parse_size

KEYS = ("type", "size", "fsType", "nfsFsType", "storageNode", *parameters.MUTABLE)
KUBERNETES_PREFIX = "csi.storage.k8s.io/"


@dataclass(frozen=True)
class EphemeralSpec:
    kind: str
    size: int
    fs_type: str
    storage_node: str | None
    backend_parameters: dict[str, str]


def backend_name(volume_id: str) -> str:
    return "eph-" + hashlib.sha256(volume_id.encode()).hexdigest()[:40]


def parse(attributes: Mapping[str, str]) -> EphemeralSpec:
    ours = {k: v for k, v in attributes.items() if not k.startswith(KUBERNETES_PREFIX)}
    unknown = sorted(k for k in ours if k not in KEYS)
    if unknown:
        raise InvalidArgument(
            f"unknown volume attribute {unknown[0][:80]!r} for an ephemeral volume; "
            f"known: {', '.join(KEYS)}"
        )
    try:
        wanted = parse_size(ours.get("size", "1Gi"), kubernetes=True)
    except ValueError:
        raise InvalidArgument(
            f"size {ours['size'][:40]!r} is not a number of bytes or a Kubernetes quantity "
            "(64Mi, 1Gi)"
        ) from None
    size, _ = requested_size(pb.CapacityRange(required_bytes=wanted))
    params = parameters.parse(
        {
            k: v
            for k, v in ours.items()
            if k in ("type", "nfsFsType", "storageNode", *parameters.MUTABLE)
        },
        {},
    )
    kind = params.type or "nbd"
    fs = ours.get("fsType", "")
    if fs and (kind != "nbd" or fs not in ("ext4", "xfs")):
        raise InvalidArgument(f"fsType {fs[:20]!r} does not apply to an ephemeral {kind} volume")
    return EphemeralSpec(
        kind, size, fs or "ext4", params.storage_node, parameters.backend_parameters(kind, params)
    )


def create_and_publish(
    nodes: StorageNodes,
    volume_id: str,
    spec: EphemeralSpec,
    me: NodeRef,
    segment: Mapping[str, str],
) -> tuple[str, str, dict[str, str]]:
    """(storage node, backend volume id, publish_context) of the volume, made if missing."""
    name = backend_name(volume_id)
    for node in nodes.names:  # a retry finds the volume wherever it was made
        try:
            v = nodes.call(node, lambda c: c.get_volume(name=name))
        except NotFound:
            continue
        return node, v.id, _publish(nodes, node, v.id, me)
    allowed = [
        n.name
        for n in nodes.config.storage_nodes
        if topology.allows(segment, n) and spec.storage_node in (None, n.name)
    ]
    failures: list[str] = []
    for node in allowed:
        req = bpb.CreateVolumeRequest(
            name=name,
            type=BACKEND_TYPES[spec.kind],
            size_bytes=spec.size,
            parameters=spec.backend_parameters,
            labels={"csi.moorage.dev/ephemeral": volume_id[:512]},
        )
        try:
            v = nodes.call(node, lambda c, r=req: c.create_volume(r))  # type: ignore[misc]
        except (Unavailable, ResourceExhausted) as e:
            failures.append(e.message)
            continue
        return node, v.id, _publish(nodes, node, v.id, me)
    raise ResourceExhausted(
        f"no storage node could make the ephemeral volume {volume_id}: "
        + ("; ".join(failures) or "none configured is reachable from this node's topology")
    )


def _publish(nodes: StorageNodes, node: str, backend_id: str, me: NodeRef) -> dict[str, str]:
    target = nodes.call(
        node, lambda c: c.publish(backend_id, me.name, me.address, single_node=True)
    )
    return publish_context(target)


def unpublish_and_delete(nodes: StorageNodes, node: str, backend_id: str, me: NodeRef) -> None:
    try:
        nodes.call(node, lambda c: c.unpublish(backend_id, me.name))
        nodes.call(node, lambda c: c.delete_volume(backend_id))
    except NotFound:
        return  # already gone

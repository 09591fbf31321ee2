"""Which storage nodes a topology allows, and in which order to try them.

A storage node's segment (``topology`` in the configuration, e.g.
``topology.csi.moorage.dev/zone: a``) is what its volumes are accessible
from.  A segment asked for by Kubernetes (a node's labels for the driver's
topology keys) allows the storage node when it has the same value for every
key the storage node's segment names.  A storage node with no segment is
reachable from everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from csi.config import StorageNodeConfig
from csi.errors import ResourceExhausted, Unavailable
from csi.proto import csi_pb2 as pb


def allows(segment: Mapping[str, str], node: StorageNodeConfig) -> bool:
    return all(segment.get(k) == v for k, v in node.topology.items())


def candidates(
    nodes: Sequence[StorageNodeConfig], requirement: pb.TopologyRequirement | None
) -> list[StorageNodeConfig]:
    """The storage nodes the requirement allows, those of preferred segments first
    (in the order of preference), then the others in configuration order."""
    if requirement is None or (not requirement.requisite and not requirement.preferred):
        return list(nodes)
    requisite = [dict(t.segments) for t in requirement.requisite]
    preferred = [dict(t.segments) for t in requirement.preferred]
    allowed = [
        n for n in nodes if not requisite or any(allows(segment, n) for segment in requisite)
    ]

    def rank(node: StorageNodeConfig) -> int:
        return next(
            (i for i, segment in enumerate(preferred) if allows(segment, node)), len(preferred)
        )

    return sorted(allowed, key=rank)  # sorted() is stable: configuration order otherwise


def accessible(node: StorageNodeConfig) -> list[pb.Topology]:
    return [pb.Topology(segments=dict(node.topology))] if node.topology else []


def place(
    nodes: Sequence[StorageNodeConfig],
    requirement: pb.TopologyRequirement | None,
    pinned: str | None,
    size: int,
    available: Callable[[str], int],
    failures: list[str],
) -> list[str]:
    """The storage nodes to try for a new volume, best first: allowed by the
    topology requirement (and ``pinned``, when one must be used), those of
    preferred segments first, then those with the most available capacity.
    A storage node that cannot answer, or has too little room, is left out
    with its reason added to ``failures``."""
    allowed = [n for n in candidates(nodes, requirement) if pinned in (None, n.name)]
    if not allowed:
        raise ResourceExhausted(
            "no configured storage node satisfies the topology requirement"
            + (f" and is {pinned}" if pinned else "")
        )
    preferred = [dict(t.segments) for t in (requirement.preferred if requirement else [])]
    scored: list[tuple[int, int, int, str]] = []
    for index, node in enumerate(allowed):
        rank = next((i for i, seg in enumerate(preferred) if allows(seg, node)), len(preferred))
        try:
            room = available(node.name)
        except Unavailable as e:
            failures.append(e.message)
            continue
        if room < size:
            failures.append(f"storage node {node.name} has {room} bytes available")
            continue
        scored.append((rank, -room, index, node.name))
    return [name for *_, name in sorted(scored)]

"""Whether the mounts the node plugin makes under kubelet's directory reach kubelet.

Kubelet, and the pods it starts, look for a volume's mounts in the host's
mount namespace. A node plugin in a container has a mount namespace of its
own: what it mounts under the kubelet directory reaches the host only if that
directory's mount is shared here (``shared:N`` in mountinfo), a peer of the
host's. Kubernetes makes it so for a volume mount with
``mountPropagation: Bidirectional``. Without it kubelet never sees the
plugin's mounts, the plugin's FUSE daemons die with its namespace, and a
restarted plugin finds loop devices still held by mounts it cannot reach.

From inside the namespace only "shared" can be checked, not that the peer
group is the host's.
"""

from __future__ import annotations

import os
from pathlib import Path

from csi.mounts.table import mount_containing
from hostio.mountinfo import MountEntry

FIX = "mount propagation of the kubelet dir must be Bidirectional/shared"


class PropagationError(ValueError):
    """Mounts made under the directory would not leave this mount namespace."""


def propagation_problem(entry: MountEntry, path: str | os.PathLike[str]) -> str | None:
    """None if mounts made on ``entry`` propagate to its peers; else one line
    saying why not and what fixes it."""
    if entry.peer_group is not None:
        return None
    if entry.master is not None:
        kind = "a slave (HostToContainer): it receives the host's mounts and sends none back"
    else:
        kind = "private: mounts made on it never leave this mount namespace"
    return (
        f"{FIX}: {os.fspath(path)} lies on the mount at {entry.mount_point}, which is {kind}; "
        "give the node plugin's volume mount of it mountPropagation: Bidirectional"
    )


def check_propagation(path: Path) -> MountEntry:
    """The mount ``path`` lies on, if mounts made under it reach the mount's
    peers; else :class:`PropagationError` with the one line to show."""
    try:
        entry = mount_containing(path)
    except (OSError, KeyError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "no mnt_id in fdinfo"
        raise PropagationError(f"cannot tell the mount propagation of {path}: {reason}") from e
    if entry is None:
        raise PropagationError(f"{FIX}: the mount {path} lies on is outside this mount namespace")
    problem = propagation_problem(entry, path)
    if problem is not None:
        raise PropagationError(problem)
    return entry

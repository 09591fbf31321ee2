"""StorageClass parameters and VolumeAttributesClass (mutable) parameters.

What a StorageClass may say (``parameters``):

====================  ==========================================================
``type``              ``nfs`` or ``nbd``; default: ``nbd`` for raw block access,
                      ``nfs`` for a multi-node writable filesystem, else ``nbd``
``nfsFsType``         ``xfs`` (default) or ``ext4``: an NFS volume's own filesystem
``fsType``            ``ext4`` or ``xfs``: an nbd volume's filesystem when the volume
                      capability names none (csi-provisioner normally puts
                      ``csi.storage.k8s.io/fstype`` there)
``squash``            NFS: ``root_squash`` (default), ``no_root_squash``, ``all_squash``
``storageNode``       place the volume on this storage node only
``iopsLimit``         NBD: requests per second over all connections (0: none), a
                      Kubernetes quantity too (``2k`` is 2000)
``bandwidthLimit``    NBD: bytes per second (0: none), a Kubernetes quantity (``100Mi``;
                      ``1G`` is 10^9, as in Kubernetes)
``ioTimeout``         seconds (1-86400) I/O on a node waits for the storage node when it
                      is gone, then fails with EIO; default: the node plugin's
                      ``io_timeout`` (120)
``csi.storage.k8s.io/pvc/name``, ``.../pvc/namespace``, ``.../pv/name``
                      added by csi-provisioner (``--extra-create-metadata``);
                      kept as the volume's labels on the storage node
``csi.storage.k8s.io/*`` any other key of Kubernetes' reserved prefix
                      (``fstype``, secret references) is the sidecars' and
                      is ignored: GetCapacity receives them unfiltered
====================  ==========================================================

``squash``, ``iopsLimit`` and ``bandwidthLimit`` are also the keys of
``mutable_parameters`` (CreateVolume) and ControllerModifyVolume.  Any other
key is INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from csi.errors import InvalidArgument
from hostio.sizes import parse_size

TYPES = ("nfs", "nbd")
FS_TYPES = ("xfs", "ext4")
SQUASH = ("root_squash", "no_root_squash", "all_squash")
MAX_LIMIT = 10**12

# The provisioner's metadata keys, and the label each becomes.
METADATA = {
    "csi.storage.k8s.io/pvc/name": "csi.storage.k8s.io/pvc-name",
    "csi.storage.k8s.io/pvc/namespace": "csi.storage.k8s.io/pvc-namespace",
    "csi.storage.k8s.io/pv/name": "csi.storage.k8s.io/pv-name",
}
RESERVED_PREFIX = "csi.storage.k8s.io/"
MUTABLE = ("squash", "iopsLimit", "bandwidthLimit")
KNOWN = ("type", "nfsFsType", "fsType", "storageNode", "ioTimeout", *MUTABLE, *METADATA)
MAX_IO_TIMEOUT = 86400
BLOCK_FS_TYPES = ("ext4", "xfs")
# The mutable keys as the storage node names them, by volume type.
BACKEND_KEYS = {
    "nbd": {"iopsLimit": "iops_limit", "bandwidthLimit": "bandwidth_limit"},
    "nfs": {"squash": "squash"},
}


@dataclass(frozen=True)
class VolumeParameters:
    """A CreateVolume's parameters, checked."""

    type: str | None = None  # None: chosen from the access type
    nfs_fs_type: str = "xfs"
    fs_type: str = ""  # nbd: the filesystem when the capability names none
    storage_node: str | None = None
    io_timeout: str = ""  # seconds, checked; "": the node plugin's default
    mutable: Mapping[str, str] = field(default_factory=dict)  # CSI keys, checked values
    labels: Mapping[str, str] = field(default_factory=dict)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidArgument(f"parameter {key}: {value[:40]!r} is not one of {', '.join(allowed)}")
    return value


def _limit(key: str, value: str) -> str:
    try:
        number = parse_size(value, kubernetes=True)
    except ValueError:
        raise InvalidArgument(
            f"parameter {key}: {value[:40]!r} is not a whole number or a Kubernetes quantity "
            "(100Mi, 1G)"
        ) from None
    if number > MAX_LIMIT:
        raise InvalidArgument(f"parameter {key}: {number} is above the maximum {MAX_LIMIT}")
    return str(number)


def check_mutable(params: Mapping[str, str], where: str = "mutable parameter") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in params.items():
        if key not in MUTABLE:
            raise InvalidArgument(
                f"{where} {key[:80]!r} is unknown or cannot change; mutable: {', '.join(MUTABLE)}"
            )
        out[key] = _choice(key, value, SQUASH) if key == "squash" else _limit(key, value)
    return out


def io_timeout(value: str, key: str = "ioTimeout") -> str:
    """A number of seconds between 1 and a day, as digits."""
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_IO_TIMEOUT:
        raise InvalidArgument(
            f"{key} {value[:40]!r} is not a number of seconds from 1 to {MAX_IO_TIMEOUT}"
        )
    return str(int(value))


def parse(params: Mapping[str, str], mutable: Mapping[str, str]) -> VolumeParameters:
    # the prefix Kubernetes reserves for its own keys (secret references,
    # fstype): csi-provisioner strips them from CreateVolume but hands a
    # StorageClass's parameters to GetCapacity as they are
    unknown = sorted(k for k in params if k not in KNOWN and not k.startswith(RESERVED_PREFIX))
    if unknown:
        raise InvalidArgument(
            f"unknown parameter {unknown[0][:80]!r}; known: {', '.join(sorted(KNOWN))}"
        )
    kind = _choice("type", params["type"], TYPES) if "type" in params else None
    fs = _choice("nfsFsType", params.get("nfsFsType", "xfs"), FS_TYPES)
    block_fs = _choice("fsType", params["fsType"], BLOCK_FS_TYPES) if "fsType" in params else ""
    node = params.get("storageNode") or None
    timeout = io_timeout(params["ioTimeout"]) if "ioTimeout" in params else ""
    from_class = check_mutable({k: params[k] for k in MUTABLE if k in params}, "parameter")
    from_request = check_mutable(mutable)
    for key in set(from_class) & set(from_request):
        if from_class[key] != from_request[key]:
            raise InvalidArgument(
                f"{key} is {params[key]!r} in the parameters but {mutable[key]!r} in the "
                "mutable parameters"
            )
    labels = {METADATA[k]: params[k] for k in METADATA if k in params}
    return VolumeParameters(
        type=kind,
        nfs_fs_type=fs,
        fs_type=block_fs,
        storage_node=node,
        io_timeout=timeout,
        mutable={**from_class, **from_request},
        labels=labels,
    )


def backend_parameters(kind: str, p: VolumeParameters) -> dict[str, str]:
    """What the storage node is given at CreateVolume for a volume of ``kind``."""
    wrong = sorted(k for k in p.mutable if k not in BACKEND_KEYS[kind])
    if wrong:
        raise InvalidArgument(f"{', '.join(wrong)} do not apply to an {kind} volume")
    out = {BACKEND_KEYS[kind][k]: v for k, v in p.mutable.items()}
    if kind == "nfs":
        out["fs_type"] = p.nfs_fs_type
        out.setdefault("squash", "root_squash")
    else:
        out = {k: v for k, v in out.items() if v != "0"}
    return out


def backend_mutable(kind: str, mutable: Mapping[str, str]) -> dict[str, str]:
    """ControllerModifyVolume's parameters as the storage node names them."""
    checked = check_mutable(mutable)
    wrong = sorted(k for k in checked if k not in BACKEND_KEYS[kind])
    if wrong:
        raise InvalidArgument(f"{', '.join(wrong)} cannot be set on an {kind} volume")
    return {BACKEND_KEYS[kind][k]: v for k, v in checked.items()}

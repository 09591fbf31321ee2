"""Validation of what callers send: names, sizes, parameters, node identities."""

from __future__ import annotations

import ipaddress
import re

from backend.errors import InvalidArgument

MIB = 1024 * 1024
MIN_SIZE = MIB
MAX_SIZE = 64 * 1024**4  # 64 TiB

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ID = re.compile(r"^[0-9a-f]{32}$")

FS_TYPES = ("xfs", "ext4")
SQUASH = ("root_squash", "no_root_squash", "all_squash")
NFS_PARAMETERS = {"fs_type", "squash"}
NBD_PARAMETERS = {"iops_limit", "bandwidth_limit"}
# What ModifyVolume may change, by volume type.
MUTABLE = {"nbd": NBD_PARAMETERS, "nfs": {"squash"}}
MAX_LIMIT = 10**12

MAX_LABELS = 32
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,252}$")
MAX_LABEL_VALUE = 512


def volume_name(name: str, what: str = "volume name") -> str:
    if not name:
        raise InvalidArgument(f"{what} is empty")
    if not _NAME.match(name) or ".." in name:
        raise InvalidArgument(
            f"{what} {name[:80]!r} is invalid: 1-128 characters of letters, digits, '.', '_' "
            "and '-', starting with a letter or digit, without '..'"
        )
    return name


def object_id(value: str, what: str = "id") -> str:
    if not _ID.match(value):
        raise InvalidArgument(f"{what} {value[:80]!r} is not a moorage id (32 hex digits)")
    return value


def size(value: int) -> int:
    """Validate a requested size and round it up to a whole MiB."""
    if value <= 0:
        raise InvalidArgument("size must be positive")
    if value > MAX_SIZE:
        raise InvalidArgument(f"size {value} exceeds the maximum of {MAX_SIZE} bytes")
    return max(MIN_SIZE, -(-value // MIB) * MIB)


def node_id(value: str) -> str:
    if not value or not _NODE_ID.match(value) or ".." in value:
        raise InvalidArgument(f"node id {value[:80]!r} is invalid")
    return value


def node_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError as e:
        raise InvalidArgument(f"node address {value[:80]!r} is not an IP address") from e


def _limit(key: str, value: str) -> str:
    if not value.isascii() or not value.isdigit() or int(value) > MAX_LIMIT:
        raise InvalidArgument(
            f"{key} {value[:20]!r} is not a whole number between 0 (no limit) and {MAX_LIMIT}"
        )
    return str(int(value))


def parameters(kind: str, params: dict[str, str]) -> dict[str, str]:
    """Check volume parameters for a type; fill defaults."""
    if kind == "nbd":
        unknown = set(params) - NBD_PARAMETERS
        if unknown:
            raise InvalidArgument(
                f"unknown parameters {sorted(unknown)} for an nbd volume; "
                f"known: {sorted(NBD_PARAMETERS)}"
            )
        return {k: _limit(k, v) for k, v in sorted(params.items())}
    unknown = set(params) - NFS_PARAMETERS
    if unknown:
        raise InvalidArgument(
            f"unknown parameters {sorted(unknown)}; known: {sorted(NFS_PARAMETERS)}"
        )
    fs = params.get("fs_type", "xfs")
    if fs not in FS_TYPES:
        raise InvalidArgument(f"fs_type {fs[:20]!r} is not one of {FS_TYPES}")
    squash = params.get("squash", "root_squash")
    if squash not in SQUASH:
        raise InvalidArgument(f"squash {squash[:20]!r} is not one of {SQUASH}")
    return {"fs_type": fs, "squash": squash}


def mutable_parameters(kind: str, params: dict[str, str]) -> dict[str, str]:
    """Check what ModifyVolume is asked to change for a volume of this type."""
    if not params:
        raise InvalidArgument("no parameters to modify")
    fixed = set(params) - MUTABLE[kind]
    if fixed:
        raise InvalidArgument(
            f"parameters {sorted(fixed)} of an {kind} volume cannot be changed; "
            f"mutable: {sorted(MUTABLE[kind])}"
        )
    if kind == "nbd":
        return parameters(kind, params)
    squash = params["squash"]
    if squash not in SQUASH:
        raise InvalidArgument(f"squash {squash[:20]!r} is not one of {SQUASH}")
    return {"squash": squash}


def labels(values: dict[str, str]) -> dict[str, str]:
    if len(values) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels, got {len(values)}")
    for key, value in values.items():
        if not _LABEL_KEY.match(key):
            raise InvalidArgument(
                f"label key {key[:80]!r} is invalid: up to 253 letters, digits, '.', '_', '/', '-'"
            )
        if len(value) > MAX_LABEL_VALUE or not value.isprintable():
            raise InvalidArgument(
                f"label {key}: value must be printable and at most {MAX_LABEL_VALUE} characters"
            )
    return dict(sorted(values.items()))

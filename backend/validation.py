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


def parameters(kind: str, params: dict[str, str]) -> dict[str, str]:
    """Check volume parameters for a type; fill defaults."""
    if kind == "nbd":
        if params:
            raise InvalidArgument(f"nbd volumes take no parameters, got {sorted(params)}")
        return {}
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

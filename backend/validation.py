"""Validation of what callers send: names, sizes, parameters, node identities."""

from __future__ import annotations

import re
from collections.abc import Iterable

from backend.api.errors import InvalidArgument
from hostio.addresses import AddressError
from hostio.addresses import node_address as _node_address

MIB = 1024 * 1024
MIN_SIZE = MIB
MAX_SIZE = 64 * 1024**4  # 64 TiB

# Always matched whole (``fullmatch``): ``$`` would let a trailing newline through.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ID = re.compile(r"[0-9a-f]{32}")

FS_TYPES = ("xfs", "ext4")
SQUASH = ("root_squash", "no_root_squash", "all_squash")
NFS_PARAMETERS = {"fs_type", "squash"}
NBD_PARAMETERS = {"iops_limit", "bandwidth_limit"}
# What ModifyVolume may change, by volume type.
MUTABLE = {"nbd": NBD_PARAMETERS, "nfs": {"squash"}}
MAX_LIMIT = 10**12

MAX_LABELS = 32
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,252}")
MAX_LABEL_VALUE = 512
# What a message shows of one value a caller sent, and how many of a list:
# an error echoing a huge input whole would not even fit in gRPC's metadata.
SHOWN = 80
SHOWN_KEYS = 4


def shown(value: str, limit: int = SHOWN) -> str:
    """``value`` quoted for a message, cut to ``limit`` characters."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def _keys(keys: Iterable[str]) -> str:
    """A few of ``keys`` for a message, each cut short, and how many more there are."""
    ordered = sorted(keys)
    listed = ", ".join(shown(k, 40) for k in ordered[:SHOWN_KEYS])
    more = len(ordered) - SHOWN_KEYS
    return f"[{listed}{f', and {more} more' if more > 0 else ''}]"


def volume_name(name: str, what: str = "volume name") -> str:
    if not name:
        raise InvalidArgument(f"{what} is empty")
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"{what} {shown(name)} is invalid: 1-128 characters of letters, digits, '.', '_' "
            "and '-', starting with a letter or digit, without '..'"
        )
    return name


def object_id(value: str, what: str = "id") -> str:
    if not _ID.fullmatch(value):
        raise InvalidArgument(f"{what} {shown(value)} is not a moorage id (32 hex digits)")
    return value


def size(value: int) -> int:
    """Validate a requested size and round it up to a whole MiB."""
    if value <= 0:
        raise InvalidArgument("size must be positive")
    if value > MAX_SIZE:
        raise InvalidArgument(f"size {value} exceeds the maximum of {MAX_SIZE} bytes")
    return max(MIN_SIZE, -(-value // MIB) * MIB)


MAX_GID = 2**32 - 2  # (gid_t)-1 means "leave the group" to chown


def group_id(value: int) -> int:
    if not 0 <= value <= MAX_GID:
        raise InvalidArgument(f"group id {value} is out of range (0..{MAX_GID})")
    return value


def node_id(value: str) -> str:
    if not value or not _NODE_ID.fullmatch(value) or ".." in value:
        raise InvalidArgument(
            f"node id {shown(value)} is invalid: 1-128 characters of letters, digits, '.', '_' "
            "and '-', starting with a letter or digit, without '..'"
        )
    return value


def node_address(value: str) -> str:
    """One node's IP address, canonical; the rule ganesha's model and the NBD
    export allow list apply too (``hostio/addresses.py``)."""
    try:
        return _node_address(value)
    except AddressError as e:
        raise InvalidArgument(str(e)) from None


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
                f"unknown parameters {_keys(unknown)} for an nbd volume; "
                f"known: {sorted(NBD_PARAMETERS)}"
            )
        return {k: _limit(k, v) for k, v in sorted(params.items())}
    unknown = set(params) - NFS_PARAMETERS
    if unknown:
        raise InvalidArgument(
            f"unknown parameters {_keys(unknown)}; known: {sorted(NFS_PARAMETERS)}"
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
            f"parameters {_keys(fixed)} of an {kind} volume cannot be changed; "
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
        if not _LABEL_KEY.fullmatch(key):
            raise InvalidArgument(
                f"label key {shown(key)} is invalid: up to 253 letters, digits, '.', '_', '/', '-'"
            )
        if len(value) > MAX_LABEL_VALUE or not value.isprintable():
            raise InvalidArgument(
                f"label {shown(key)}: value must be printable and at most "
                f"{MAX_LABEL_VALUE} characters"
            )
    return dict(sorted(values.items()))

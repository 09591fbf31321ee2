"""Checks of request fields the services share: names, ids, capacity ranges."""

from __future__ import annotations

import hashlib
import re

from csi.errors import InvalidArgument, OutOfRange
from csi.ids import MAX_ID_BYTES
from csi.proto import csi_pb2 as pb

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_SIZE = GIB
MIN_SIZE = MIB
MAX_SIZE = 64 << 40  # the storage node's own maximum
MAX_NAME_BYTES = 256
_BACKEND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def backend_name(name: str, what: str = "name") -> str:
    """The storage node's name for a CSI name: itself when it fits the storage
    node's alphabet, else a digest of it (the same for every replica)."""
    if not name:
        raise InvalidArgument(f"{what} is empty")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(f"{what} is longer than {MAX_NAME_BYTES} bytes")
    if _BACKEND_NAME.fullmatch(name) and ".." not in name:
        return name
    return "csi-" + hashlib.sha256(name.encode()).hexdigest()[:60]


def requested_size(cr: pb.CapacityRange | None) -> tuple[int, int]:
    """(size to give, limit) for a capacity range; limit 0 is none.

    Sizes are whole MiB on the storage node: the smallest whole-MiB size at
    or above ``required_bytes`` (1 GiB when neither bound is set), which must
    not pass ``limit_bytes``.
    """
    required = cr.required_bytes if cr is not None else 0
    limit = cr.limit_bytes if cr is not None else 0
    if required < 0 or limit < 0:
        raise InvalidArgument("capacity_range bytes cannot be negative")
    if limit and required > limit:
        raise InvalidArgument(f"required_bytes {required} is above limit_bytes {limit}")
    size = required or min(DEFAULT_SIZE, limit or DEFAULT_SIZE)
    size = max(MIN_SIZE, -(-size // MIB) * MIB)
    if limit and size > limit:
        size = limit // MIB * MIB
        if size < max(required, MIN_SIZE):
            raise OutOfRange(
                f"no whole-MiB size of at least {max(required, MIN_SIZE)} bytes fits under "
                f"limit_bytes {limit}"
            )
    if size > MAX_SIZE:
        raise OutOfRange(f"{size} bytes is above the maximum volume size {MAX_SIZE}")
    return size, limit


def require(value: str, what: str) -> str:
    """A required id field: present, and not absurdly long."""
    if not value:
        raise InvalidArgument(f"{what} is missing")
    if len(value.encode()) > MAX_ID_BYTES * 2:
        raise InvalidArgument(f"{what} is longer than {MAX_ID_BYTES * 2} bytes")
    return value

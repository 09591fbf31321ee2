"""The ids the plugin hands to Kubernetes, and what they encode.

- A **volume id** (and a **snapshot id**) is ``STORAGE-NODE:ID``: the name of
  the storage node that holds it (from the configuration) and the storage
  node's own 32-hex-digit id.  The controller keeps no state: any replica
  can answer any call from the id alone.
- A **node id** is ``NAME@ADDRESS``: the Kubernetes node's name and the IP
  address storage nodes see it as.  ControllerPublishVolume receives only
  the node id, and the NBD export or NFS client list it opens must name
  that address, so the node plugin puts it in the id it reports in
  NodeGetInfo.

Parsing never raises for a string that is merely not ours: it returns None,
and each RPC answers what the spec says for an unknown object.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from hostio.addresses import AddressError
from hostio.addresses import node_address as check_node_address

MAX_ID_BYTES = 128  # the spec's recommended maximum for ids Kubernetes stores

# Matched whole (``fullmatch``): ``$`` would let a trailing newline through.
_OBJECT = re.compile(r"([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?):([0-9a-f]{32})")
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class ObjectRef:
    """A volume or snapshot: its storage node and its id there."""

    storage_node: str
    backend_id: str

    def __str__(self) -> str:
        return f"{self.storage_node}:{self.backend_id}"


def parse_object_id(value: str) -> ObjectRef | None:
    m = _OBJECT.fullmatch(value)
    return ObjectRef(m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class NodeRef:
    name: str
    address: str

    def __str__(self) -> str:
        return f"{self.name}@{self.address}"


def parse_node_id(value: str) -> NodeRef | None:
    name, at, address = value.rpartition("@")
    if not at or not _NODE_NAME.fullmatch(name) or ".." in name:
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return NodeRef(name, str(ip))


def address_problem(node: NodeRef) -> str | None:
    """Why a storage node would refuse the node's address (the one rule of
    ``hostio/addresses.py``: no unspecified, broadcast, multicast or IPv4-mapped
    address), or None.  Checked before any storage node records anything."""
    try:
        check_node_address(node.address, "its address")
    except AddressError as e:
        return str(e)
    return None


def node_id(name: str, address: str) -> str:
    ref = parse_node_id(f"{name}@{address}")
    if ref is None:
        raise ValueError(
            f"node id from name {name[:80]!r} and address {address[:80]!r} is invalid: the name "
            "is 1-128 letters, digits, '.', '_' and '-'; the address an IP address"
        )
    return str(ref)

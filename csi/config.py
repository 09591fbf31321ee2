"""The CSI plugin's configuration file: which storage nodes it drives, and this node.

The file is TOML (Python's own ``tomllib`` reads it; no extra dependency)::

    # every storage node the controller may place volumes on
    [[storage_nodes]]
    name = "sn-a"                           # DNS label; part of every volume id
    address = "10.0.0.10:7443"              # backend API: HOST:PORT or unix:PATH
    token_file = "/etc/moorage/token"       # bearer token (optional)
    tls_ca = "/etc/moorage/ca.crt"          # mutual TLS (optional, each a PEM file)
    tls_cert = "/etc/moorage/client.crt"
    tls_key = "/etc/moorage/client.key"
    timeout = 300                           # seconds per backend call
    [storage_nodes.topology]
    "topology.csi.moorage.dev/zone" = "a"

    # this node (node mode; optional in controller mode)
    [node]
    address = "10.0.0.21"                   # the IP storage nodes see this node as
    io_timeout = 120                        # seconds I/O waits for a lost storage node
    fuse_attachment_mib = 64                # memory budgeted per FUSE attachment
    nbd_devices = 0                         # nbd devices to count on (0: automatic)
    [node.topology]
    "topology.csi.moorage.dev/zone" = "a"

Every field is checked when the file is read; a bad one is an error naming
the field and what it should be, and the plugin does not start.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostio.addresses import AddressError, HostPortError, parse_host_port
from hostio.addresses import node_address as check_node_address

TOPOLOGY_PREFIX = "topology.csi.moorage.dev/"
NODE_TOPOLOGY_KEY = TOPOLOGY_PREFIX + "node"

# A storage node's name is part of every volume id it holds: a DNS label.
_STORAGE_NODE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# Topology keys and values as Kubernetes takes them for node labels.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
_UNIX = "unix:"


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or has a bad field."""


@dataclass(frozen=True)
class StorageNodeConfig:
    name: str
    address: str
    token_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    timeout: float = 300.0
    topology: Mapping[str, str] = field(default_factory=dict)


# How long I/O on a staged volume waits for a storage node that went away
# before it fails with EIO (fuse.nbdconnections.DEFAULT_IO_TIMEOUT; a
# StorageClass's ioTimeout overrides it), and the most it may be.
DEFAULT_IO_TIMEOUT = 120.0
MAX_IO_TIMEOUT = 86400.0
# Memory budgeted for each FUSE attachment (a process each): NodeGetInfo's
# count on the FUSE path is what the host has available divided by it.
DEFAULT_FUSE_ATTACHMENT_MIB = 64
MAX_FUSE_ATTACHMENT_MIB = 1 << 20  # 1 TiB
# The nbd devices NodeGetInfo's count takes as the pool on the kernel-nbd path
# (csi.attach.limits): 0 is the automatic rule; the most is a policy bound well
# under the kernel's minor numbers.
MAX_NBD_DEVICES = 65536


@dataclass(frozen=True)
class NodeConfig:
    address: str | None = None
    io_timeout: float = DEFAULT_IO_TIMEOUT
    topology: Mapping[str, str] = field(default_factory=dict)
    fuse_attachment_mib: int = DEFAULT_FUSE_ATTACHMENT_MIB
    nbd_devices: int = 0


@dataclass(frozen=True)
class PluginConfig:
    storage_nodes: tuple[StorageNodeConfig, ...]
    node: NodeConfig = field(default_factory=NodeConfig)

    def storage_node(self, name: str) -> StorageNodeConfig | None:
        return next((s for s in self.storage_nodes if s.name == name), None)


def topology_key(key: str, where: str) -> str:
    prefix, slash, name = key.rpartition("/")
    if not slash or not _LABEL_PREFIX.fullmatch(prefix) or not _LABEL_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: topology key {key[:80]!r} is not a label key of the form "
            "PREFIX/NAME (e.g. topology.csi.moorage.dev/zone)"
        )
    return key


def _topology(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table of topology key = value")
    out: dict[str, str] = {}
    for key, val in value.items():
        topology_key(key, where)
        if key == NODE_TOPOLOGY_KEY:
            raise ConfigError(f"{where}: {NODE_TOPOLOGY_KEY} is set by the plugin itself")
        if not isinstance(val, str) or not _LABEL_VALUE.fullmatch(val):
            raise ConfigError(
                f"{where}: value of {key} must be a label value (up to 63 letters, digits, "
                "'.', '_', '-', starting and ending with a letter or digit)"
            )
        out[key] = val
    return out


def _take(table: dict[str, Any], key: str, kind: type, where: str, required: bool = False) -> Any:
    if key not in table:
        if required:
            raise ConfigError(f"{where}: {key} is required")
        return None
    value = table.pop(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{where}: {key} must be a {kind.__name__}")
    return value


def _no_more(table: Mapping[str, Any], where: str, known: str) -> None:
    if table:
        raise ConfigError(f"{where}: unknown field(s) {sorted(table)}; known: {known}")


def _address(value: str, where: str) -> str:
    if value.startswith(_UNIX):
        if not value[len(_UNIX) :].lstrip("/"):
            raise ConfigError(f"{where}: address {value!r} names no socket path")
        return value
    try:
        parse_host_port(value, "address")
    except HostPortError as e:
        raise ConfigError(f"{where}: {e}; or give unix:PATH") from None
    return value


def _file(value: str | None, where: str, key: str) -> Path | None:
    if value is None:
        return None
    path = Path(value)
    if not path.is_absolute():
        raise ConfigError(f"{where}: {key} must be an absolute path")
    return path


def _storage_node(table: object, index: int) -> StorageNodeConfig:
    where = f"storage_nodes[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    t = dict(table)
    name = _take(t, "name", str, where, required=True)
    if not _STORAGE_NODE.fullmatch(name):
        raise ConfigError(
            f"{where}: name {name[:80]!r} must be a DNS label (1-63 lowercase letters, "
            "digits and '-')"
        )
    where = f"storage node {name!r}"
    address = _address(_take(t, "address", str, where, required=True), where)
    token = _file(_take(t, "token_file", str, where), where, "token_file")
    ca = _file(_take(t, "tls_ca", str, where), where, "tls_ca")
    cert = _file(_take(t, "tls_cert", str, where), where, "tls_cert")
    key = _file(_take(t, "tls_key", str, where), where, "tls_key")
    if (cert is None) != (key is None):
        raise ConfigError(f"{where}: tls_cert and tls_key go together")
    if cert is not None and ca is None:
        raise ConfigError(f"{where}: a client certificate needs tls_ca to verify the server")
    timeout = _take(t, "timeout", float, where)
    if timeout is not None and not 1 <= timeout <= 3600:
        raise ConfigError(f"{where}: timeout must be between 1 and 3600 seconds")
    topology = _topology(t.pop("topology", {}), f"{where} topology")
    _no_more(t, where, "name, address, token_file, tls_ca, tls_cert, tls_key, timeout, topology")
    return StorageNodeConfig(
        name=name,
        address=address,
        token_file=token,
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
        timeout=timeout or 300.0,
        topology=topology,
    )


def _node(table: object) -> NodeConfig:
    where = "node"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    t = dict(table)
    address = _take(t, "address", str, where)
    if address is not None:
        address = node_address(address, f"{where}.address")
    io_timeout = _take(t, "io_timeout", float, where)
    if io_timeout is not None and not 1 <= io_timeout <= MAX_IO_TIMEOUT:
        raise ConfigError(f"{where}: io_timeout must be between 1 and {MAX_IO_TIMEOUT:.0f} seconds")
    fuse_mib = _take(t, "fuse_attachment_mib", int, where)
    if fuse_mib is not None and not 1 <= fuse_mib <= MAX_FUSE_ATTACHMENT_MIB:
        raise ConfigError(
            f"{where}: fuse_attachment_mib must be between 1 and {MAX_FUSE_ATTACHMENT_MIB} (MiB)"
        )
    nbd_devices = _take(t, "nbd_devices", int, where)
    if nbd_devices is not None and not 0 <= nbd_devices <= MAX_NBD_DEVICES:
        raise ConfigError(
            f"{where}: nbd_devices must be between 0 (automatic) and {MAX_NBD_DEVICES}"
        )
    topology = _topology(t.pop("topology", {}), f"{where} topology")
    _no_more(t, where, "address, io_timeout, fuse_attachment_mib, nbd_devices, topology")
    return NodeConfig(
        address=address,
        io_timeout=DEFAULT_IO_TIMEOUT if io_timeout is None else io_timeout,
        topology=topology,
        fuse_attachment_mib=DEFAULT_FUSE_ATTACHMENT_MIB if fuse_mib is None else fuse_mib,
        nbd_devices=nbd_devices or 0,
    )


def node_address(value: str, where: str = "node address") -> str:
    """The address storage nodes see this node as: the rule the storage node
    applies to it too (``hostio/addresses.py``), so a publication never fails on it."""
    try:
        return check_node_address(value, where)
    except AddressError as e:
        raise ConfigError(str(e)) from None


def parse_config(data: Mapping[str, Any]) -> PluginConfig:
    """Check a parsed configuration; the first bad field raises ConfigError."""
    t = dict(data)
    raw_nodes = t.pop("storage_nodes", [])
    if not isinstance(raw_nodes, list):
        raise ConfigError("storage_nodes must be an array of tables ([[storage_nodes]])")
    nodes = tuple(_storage_node(n, i) for i, n in enumerate(raw_nodes))
    names = [n.name for n in nodes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"storage node names must be unique: {duplicates} repeated")
    node = _node(t.pop("node", {}))
    _no_more(t, "configuration", "storage_nodes, node")
    return PluginConfig(storage_nodes=nodes, node=node)


def load_config(path: Path) -> PluginConfig:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e

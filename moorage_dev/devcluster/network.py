"""The cluster's network: namespaces, a bridge and veths, nothing on the host's interfaces.

The control plane's namespace holds the bridge and the API server's address;
each node's namespace holds one end of a veth (its node address) whose other
end is on the bridge.  Pod ranges are routed to their node inside the
control plane's namespace; the pod and service ranges end in blackhole
routes there, and no namespace has a route out of the machine.
"""

from __future__ import annotations

from pathlib import Path

from hostio import tools as hosttools
from moorage_dev.devcluster.layout import (
    BRIDGE,
    CONTROL_ADDRESS,
    CONTROL_NS,
    NODE_NETWORK,
    POD_NETWORK,
    SERVICE_NETWORK,
    Node,
)

PREFIX = NODE_NETWORK.prefixlen
IP_TIMEOUT = 30.0  # one `ip` or `sysctl` call


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    hosttools.run(argv, timeout=IP_TIMEOUT)


def _sysctl(netns: str, key: str, value: str) -> None:
    hosttools.run(
        ["ip", "netns", "exec", netns, "sysctl", "-q", "-w", f"{key}={value}"],
        timeout=IP_TIMEOUT,
    )


def exists(netns: str) -> bool:
    return Path("/run/netns", netns).exists()


def up(nodes: list[Node]) -> None:
    """Create what is missing (idempotent)."""
    if not exists(CONTROL_NS):
        _ip("netns", "add", CONTROL_NS)
        _ip("link", "set", "lo", "up", netns=CONTROL_NS)
        _ip("link", "add", BRIDGE, "type", "bridge", netns=CONTROL_NS)
        _ip("addr", "add", f"{CONTROL_ADDRESS}/{PREFIX}", "dev", BRIDGE, netns=CONTROL_NS)
        _ip("link", "set", BRIDGE, "up", netns=CONTROL_NS)
        _ip("route", "add", "blackhole", POD_NETWORK, netns=CONTROL_NS)
        _ip("route", "add", "blackhole", SERVICE_NETWORK, netns=CONTROL_NS)
        _sysctl(CONTROL_NS, "net.ipv4.ip_forward", "1")
    for node in nodes:
        if exists(node.netns):
            continue
        _ip("netns", "add", node.netns)
        _ip("link", "set", "lo", "up", netns=node.netns)
        _ip(
            "link", "add", "eth0", "netns", node.netns,
            "type", "veth", "peer", "name", node.veth, "netns", CONTROL_NS,
        )  # fmt: skip
        _ip("link", "set", node.veth, "master", BRIDGE, "up", netns=CONTROL_NS)
        _ip("addr", "add", f"{node.address}/{PREFIX}", "dev", "eth0", netns=node.netns)
        _ip("link", "set", "eth0", "up", netns=node.netns)
        _ip("route", "add", "default", "via", CONTROL_ADDRESS, netns=node.netns)
        _ip("route", "add", node.pod_cidr, "via", node.address, netns=CONTROL_NS)
        _sysctl(node.netns, "net.ipv4.ip_forward", "1")


def down(nodes: list[Node]) -> None:
    """Delete the namespaces (their veths go with them)."""
    for netns in [*(n.netns for n in nodes), CONTROL_NS]:
        if exists(netns):
            _ip("netns", "delete", netns)

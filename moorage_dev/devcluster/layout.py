"""Names, addresses and paths of the development cluster (one place)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

#: the control plane's network namespace; it holds the bridge the nodes hang on
CONTROL_NS = "moorage-e2e-cp"
BRIDGE = "mre2e0"
NODE_NETWORK = ipaddress.ip_network("10.213.0.0/24")
CONTROL_ADDRESS = "10.213.0.1"
SERVICE_NETWORK = "10.214.0.0/24"
KUBERNETES_SERVICE = "10.214.0.1"
POD_NETWORK = "10.215.0.0/16"
API_PORT = 6443
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
NAMESPACE = "moorage"
RELEASE = "moorage"


@dataclass(frozen=True)
class Node:
    """One kubelet: its name, namespaces, addresses and directories."""

    index: int
    name: str
    root: Path

    @property
    def netns(self) -> str:
        return f"moorage-e2e-{self.name}"

    @property
    def address(self) -> str:
        return str(NODE_NETWORK.network_address + 10 + self.index)

    @property
    def pod_cidr(self) -> str:
        return f"10.215.{self.index}.0/24"

    @property
    def first(self) -> bool:
        """The first node shares the host's mount table; the others have their own."""
        return self.index == 1

    @property
    def mount_ns(self) -> Path | None:
        """The file pinning a later node's mount namespace (None: the host's)."""
        return None if self.first else Path("/run/moorage-e2e") / f"{self.name}.mnt"

    @property
    def cgroup_root(self) -> str:
        """Where this node's kubelet puts its pods, in every cgroup hierarchy."""
        return f"moorage-e2e-{self.name}"

    @property
    def veth(self) -> str:
        """The veth end on the bridge, in the control plane's namespace."""
        return f"mre2e-{self.name}"

    @property
    def dir(self) -> Path:
        return self.root / "nodes" / self.name

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def containerd_state(self) -> Path:
        return Path("/run/moorage-e2e") / self.name / "containerd"


@dataclass(frozen=True)
class Layout:
    """Where everything of one cluster lives."""

    root: Path = Path(os.environ.get("MOORAGE_E2E_DIR", "/var/lib/moorage-e2e"))
    kubelet_dir: Path = Path("/var/lib/kubelet")

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def storage_dir(self) -> Path:
        """The storage node's pool and catalog (chart: storageNode.*HostPath)."""
        return self.root / "storage"

    @property
    def csi_state_dir(self) -> Path:
        return self.root / "csi-state"

    @property
    def nodes(self) -> list[Node]:
        return [Node(1, "node-a", self.root), Node(2, "node-b", self.root)]

    @property
    def storage_node(self) -> Node:
        return self.nodes[0]

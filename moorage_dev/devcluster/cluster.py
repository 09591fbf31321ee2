"""``up``, ``status`` and ``down`` of the development cluster."""

from __future__ import annotations

import functools
import json
import logging
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hostio import tools as hosttools
from hostio.atomicfile import write_atomically
from hostio.mountinfo import parse_mountinfo, read_mountinfo
from moorage_dev.devcluster import cleanup, control, network, procs
from moorage_dev.devcluster import node as nodes
from moorage_dev.devcluster.kube import Kube, KubectlError
from moorage_dev.devcluster.layout import CONTROL_NS, NAMESPACE, RELEASE, Layout, Node
from moorage_dev.devcluster.tools import Tools

log = logging.getLogger("moorage_dev.devcluster")
CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "moorage"
SECOND_NODE_TAINT = "moorage.dev/e2e-second-node=true"
MOUNT_TIMEOUT = 30.0  # a bind mount or propagation change, local and quick
SYSTEM_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease", NAMESPACE}


def _step(report: Callable[[str], None], started: float, text: str) -> None:
    report(f"[{time.monotonic() - started:7.1f} s] {text}")


def _shared_bind(path: Path) -> None:
    """``path`` as a shared mount of its own: hostPath volumes with Bidirectional need it."""
    path.mkdir(parents=True, exist_ok=True)
    if str(path) not in cleanup._mount_points():
        hosttools.run(["mount", "--bind", str(path), str(path)], timeout=MOUNT_TIMEOUT)
    hosttools.run(["mount", "--make-rshared", str(path)], timeout=MOUNT_TIMEOUT)


def up(
    layout: Layout, tools: Tools, report: Callable[[str], None] = print, install: bool = True
) -> Kube:
    """Bring the cluster up (what already runs is kept) and install moorage's chart."""
    started = time.monotonic()
    layout.root.mkdir(parents=True, exist_ok=True)
    _shared_bind(layout.storage_dir)
    network.up(layout.nodes)
    _step(report, started, f"network: {CONTROL_NS} + {', '.join(n.netns for n in layout.nodes)}")
    control.certificates(layout)
    control.up(layout, tools)
    kube = Kube(layout, tools)
    _step(report, started, "control plane: etcd, kube-apiserver, controller-manager, scheduler")
    archives = [*sorted(tools.images.rglob("*.tar")), tools.moorage_image]
    # kubelet makes its directory a shared mount; made here, in the host's mount
    # table, the first node's mount namespace (a copy) shares its pods' mounts back
    _shared_bind(layout.kubelet_dir)
    for node in layout.nodes:
        nodes.certificates(layout, node)
        nodes.make_cgroup_root(node)
        nodes.make_mount_namespace(layout, node)
        nodes.start_init(layout, node)
        nodes.start_containerd(layout, node)
        nodes.import_images(node, archives)
        _step(report, started, f"{node.name}: containerd, {len(archives)} images imported")
        nodes.start_kubelet(layout, node, tools)
        nodes.start_proxy(layout, node, tools)
    for node in layout.nodes:
        kube.wait_until(f"node {node.name} Ready", functools.partial(_node_ready, kube, node.name))
    for node in layout.nodes[1:]:
        # only what tolerates it lands on a later node: the plugin's DaemonSet
        # does, and so do the tests about several nodes
        kube("taint", "node", node.name, f"{SECOND_NODE_TAINT}:NoSchedule", "--overwrite")
    _step(report, started, "nodes Ready: " + ", ".join(n.name for n in layout.nodes))
    if install:
        install_moorage(layout, kube)
        _step(report, started, "moorage installed by its Helm chart, plugin registered")
    return kube


def _node_fuse_devices(layout: Layout, node: Node, prefixes: list[Path]) -> set[int]:
    """FUSE filesystems under ``prefixes`` in the node's own mount namespace."""
    try:
        mounts = read_mountinfo(nodes.init_pid(layout, node))
    except (procs.ClusterError, OSError):
        return set()
    return cleanup.fuse_devices_under(prefixes, mounts)


def _node_ready(kube: Kube, name: str) -> bool:
    node = kube.get("node", name)
    if node is None:
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def _manifests(tools: Tools) -> Path:
    return tools.images / "manifests"


def install_moorage(layout: Layout, kube: Kube, sidecars: bool = True) -> None:
    """Snapshot CRDs and controller, then moorage's chart, as an operator installs them.

    ``sidecars``: the chart's default, kubernetes-csi's node-driver-registrar and
    livenessprobe; False: the plugin registers with kubelet and serves /healthz itself.
    """
    sn = layout.storage_node
    kube("label", "node", sn.name, "moorage.dev/storage-node=true", "--overwrite")
    manifests = _manifests(kube.tools)
    for crd in sorted((manifests / "crd").glob("*.yaml")):
        kube("apply", "--server-side", "-f", str(crd))
    for part in sorted((manifests / "snapshot-controller").glob("*.yaml")):
        kube("apply", "-f", str(part))
    if kube.get("namespace", NAMESPACE) is None:
        kube("create", "namespace", NAMESPACE)
    if kube.get("secret", "moorage-backend-token", NAMESPACE) is None:
        kube(
            "create", "secret", "generic", "moorage-backend-token", "-n", NAMESPACE,
            f"--from-literal=token={secrets.token_urlsafe(24)}",
        )  # fmt: skip
    values = {
        "storageNode": {
            "address": f"{sn.address}:7443",
            "poolHostPath": str(layout.storage_dir / "pool"),
            "dataHostPath": str(layout.storage_dir / "data"),
            "loopPoolSize": "32Gi",
        },
        "node": {"stateHostPath": str(layout.csi_state_dir)},
        "sidecars": {"registrar": sidecars, "livenessprobe": sidecars},
    }
    values_file = layout.root / "values.json"
    write_atomically(values_file, json.dumps(values, indent=2), mode=0o644)
    kube.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--values", str(values_file), "--wait", "--timeout", "5m",
    )  # fmt: skip
    kube.wait_until("moorage's pods ready", lambda: _all_ready(kube, NAMESPACE), timeout=300)
    kube.wait_until(
        "csi.moorage.dev registered on every node",
        lambda: all(_registered(kube, n.name) for n in layout.nodes),
        timeout=120,
    )


def _all_ready(kube: Kube, namespace: str) -> bool:
    pods = json.loads(kube("get", "pods", "-n", namespace, "-o", "json"))["items"]
    return bool(pods) and all(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
        for p in pods
    )


def _registered(kube: Kube, node: str) -> bool:
    csinode = kube.get("csinode", node)
    drivers = (csinode or {}).get("spec", {}).get("drivers") or []
    return any(d["name"] == "csi.moorage.dev" for d in drivers)


def status(layout: Layout, tools: Tools | None) -> dict[str, Any]:
    """What runs, and what the API says about nodes and moorage's pods."""
    result: dict[str, Any] = {
        "daemons": {name: procs.running(layout, name) for name in procs.known(layout)},
        "namespaces": {
            n: network.exists(n) for n in [CONTROL_NS, *(x.netns for x in layout.nodes)]
        },
    }
    if tools is not None and procs.running(layout, "kube-apiserver"):
        kube = Kube(layout, tools)
        try:
            result["nodes"] = {
                n["metadata"]["name"]: next(
                    c["status"] for c in n["status"]["conditions"] if c["type"] == "Ready"
                )
                for n in kube.get("nodes")["items"]
            }
            result["pods"] = _pods(kube)
        except (KubectlError, subprocess.SubprocessError, hosttools.ToolError) as e:
            result["api"] = str(e)
    return result


def _pods(kube: Kube) -> dict[str, str]:
    pods = json.loads(kube("get", "pods", "--all-namespaces", "-o", "json"))["items"]
    return {
        f"{p['metadata']['namespace']}/{p['metadata']['name']}": p["status"]["phase"] for p in pods
    }


def _graceful(layout: Layout, kube: Kube, report: Callable[[str], None]) -> None:
    """Workloads and claims away through the API, so the plugin unmounts and detaches."""
    namespaces = json.loads(kube("get", "namespaces", "-o", "json"))["items"]
    for ns in namespaces:
        name = ns["metadata"]["name"]
        if name not in SYSTEM_NAMESPACES:
            kube.run("delete", "namespace", name, "--wait=false", check=False)
    kube.run("delete", "all,pvc", "--all", "-n", "default", "--wait=false", check=False)

    def user_pods() -> list[str]:
        return [
            p for p in _pods(kube)
            if p.startswith("default/") or p.split("/")[0] not in SYSTEM_NAMESPACES
        ]  # fmt: skip

    kube.wait_until("workloads gone", lambda: not user_pods(), timeout=180)
    kube.wait_until("volumes deleted", lambda: not kube.get("pv")["items"], timeout=180)
    kube.wait_until("attachments gone", lambda: not kube.get("volumeattachments")["items"], 180)
    if RELEASE in kube.helm("list", "--namespace", NAMESPACE, "--short").split():
        kube.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "3m")
    report("workloads, claims and the chart removed through the API")


def down(layout: Layout, tools: Tools | None, report: Callable[[str], None] = print) -> None:
    """Stop and remove everything ``up`` made, even when the graceful part fails."""
    started = time.monotonic()
    if tools is not None and procs.running(layout, "kube-apiserver"):
        kube = Kube(layout, tools)
        try:
            if kube.ready():
                _graceful(layout, kube, report)
        except (KubectlError, TimeoutError, subprocess.SubprocessError, hosttools.ToolError) as e:
            report(f"graceful teardown incomplete ({e}); removing by force")
    # "kubepods": kubelet's default root, should a node have run without ours
    cgroups = [n.cgroup_root for n in layout.nodes] + [cleanup.FUSE_CGROUP, "kubepods"]
    # the FUSE block files' filesystems, found before they are unmounted, in
    # every mount namespace the nodes had: a node's own goes with its process 1
    prefixes = [layout.kubelet_dir, layout.csi_state_dir]
    fuse_devices: set[int] = set()
    for node in layout.nodes:
        for name in reversed(nodes.daemons(node)):
            if name.startswith("containerd"):
                sockets = [n.containerd_socket for n in layout.nodes]
                killed = cleanup.kill_containers(cgroups, sockets)
                _step(report, started, f"{killed} container processes killed")
            if name.startswith("init-"):
                fuse_devices |= _node_fuse_devices(layout, node, prefixes)
                nodes.stop_init(layout, node)
            else:
                procs.stop(layout, name)
            _step(report, started, f"{name} stopped")
    control.down(layout)
    for name in procs.known(layout):
        procs.stop(layout, name)
    _step(report, started, "daemons stopped")
    cleanup.remove_pod_netns()
    fuse_devices |= cleanup.fuse_devices_under(prefixes)
    for node in layout.nodes:
        if node.mount_ns is not None and node.mount_ns.exists():
            argv = ["nsenter", f"--mount={node.mount_ns}", "cat", "/proc/self/mountinfo"]
            try:
                inside = subprocess.run(argv, capture_output=True, timeout=30).stdout
            except subprocess.TimeoutExpired:
                inside = b""
            mounts = parse_mountinfo(inside, f"mountinfo of {node.mount_ns}")
            fuse_devices |= cleanup.fuse_devices_under(prefixes, mounts)
    gone = cleanup.unmount_under(
        [layout.kubelet_dir, layout.root, Path("/run/moorage-e2e")]
        + [n.containerd_state for n in layout.nodes]
    )
    loops = cleanup.detach_loops(
        [layout.storage_dir, layout.kubelet_dir, *(n.dir / "csi-state" for n in layout.nodes)],
        fuse_devices,
    )
    cleanup.remove_cgroups(cgroups)
    network.down(layout.nodes)
    _step(
        report,
        started,
        f"{len(gone)} mounts and {len(loops)} loop devices removed, namespaces deleted",
    )
    for path in (layout.kubelet_dir, layout.root, Path("/run/moorage-e2e")):
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
    _step(report, started, "cluster directories removed")

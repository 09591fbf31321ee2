"""A node: containerd, kubelet and kube-proxy in the node's network namespace."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from hostio import tools as hosttools
from hostio.atomicfile import write_atomically
from hostio.mountinfo import read_mountinfo
from moorage_dev.devcluster import pki, procs
from moorage_dev.devcluster.layout import (
    API_PORT,
    CONTROL_ADDRESS,
    PAUSE_IMAGE,
    POD_NETWORK,
    Layout,
    Node,
)
from moorage_dev.devcluster.tools import Tools

CNI_BIN = "/usr/lib/cni"
MOUNT_TIMEOUT = 30.0  # bind mounts and the namespace set-up script
CTR_TIMEOUT = 600.0  # `ctr images import` of the largest archive takes about a minute


def daemons(node: Node) -> list[str]:
    """The node's daemons in the order they start (and stop in reverse): its
    process 1 first, the namespaces the others join."""
    return [
        f"init-{node.name}",
        f"containerd-{node.name}",
        f"kubelet-{node.name}",
        f"kube-proxy-{node.name}",
    ]


def start_init(layout: Layout, node: Node) -> None:
    """The node's process 1 (moorage_dev.devcluster.nodeinit), in PID and mount
    namespaces of the node's own.

    Its mount namespace is a copy of the node's (the host's for the first
    node, the pinned one for a later node) in which the shared mounts stay
    peers, so pods' mounts under kubelet's directory still reach the host;
    only /proc differs: made private there and mounted anew for the node's PID
    namespace, so the node's /proc/1 is this process, as on a real node.
    ``unshare --kill-child``: when unshare is stopped the whole node goes.
    """
    init = [sys.executable, "-m", "moorage_dev.devcluster.nodeinit"]
    # other programs' mounts dropped from the copy first, then process 1 takes over
    script = f"{shlex.join([*init, '--drop-mounts'])} && exec {shlex.join(init)}"
    argv = [
        "unshare", "--mount", "--propagation", "unchanged", "--pid", "--fork",
        "--mount-proc", "--kill-child", "sh", "-c", script,
    ]  # fmt: skip
    name = f"init-{node.name}"
    procs.start(layout, name, argv, netns=node.netns, mountns=node.mount_ns)
    # unshare's child mounts the node's /proc, then becomes the init: only then
    # may anything join its namespaces
    procs.wait_for(
        f"{name} running",
        lambda: _is_init(init_pid(layout, node)),
        timeout=30,
        log=layout.logs / f"{name}.log",
        alive=lambda: procs.running(layout, name),
    )


def _is_init(pid: int) -> bool:
    """Whether ``pid`` is already nodeinit itself (not the shell before it)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return False
    return argv[-3:-1] == ["-m", "moorage_dev.devcluster.nodeinit"] and argv[-1] == ""


def stop_init(layout: Layout, node: Node) -> None:
    """End the node's process 1, and with it every process of the node.

    unshare itself waits out SIGTERM for its child, so the child is killed;
    the kernel then kills the rest of the node's PID namespace."""
    name = f"init-{node.name}"
    unshare = procs.pid_of(layout, name)
    if unshare is not None:
        for child in procs.children(unshare):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    procs.stop(layout, name)


def init_pid(layout: Layout, node: Node) -> int:
    """The host's pid of the node's process 1 (unshare's one child)."""
    name = f"init-{node.name}"
    unshare = procs.pid_of(layout, name)
    if unshare is None:
        raise procs.ClusterError(f"{name} is not running (see {layout.logs / name}.log)")
    return procs.forked_child(unshare, name)


def certificates(layout: Layout, node: Node) -> None:
    p = layout.pki
    node.dir.mkdir(parents=True, exist_ok=True)
    server = f"https://{CONTROL_ADDRESS}:{API_PORT}"
    pki.issue(p, pki.Identity(f"kubelet-{node.name}", f"system:node:{node.name}", "system:nodes"))
    pki.issue(
        p,
        pki.Identity(
            f"kubelet-serving-{node.name}", node.name, ips=(node.address,), dns=(node.name,)
        ),
    )
    pki.kubeconfig(node.dir / "kubelet.kubeconfig", p, f"kubelet-{node.name}", server)
    pki.issue(p, pki.Identity("kube-proxy", "system:kube-proxy"))
    pki.kubeconfig(node.dir / "kube-proxy.kubeconfig", p, "kube-proxy", server)


def _containerd_config(node: Node) -> Path:
    base = node.dir / "containerd"
    base.mkdir(parents=True, exist_ok=True)
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    text = f"""\
version = 2
root = "{base / "root"}"
state = "{node.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]

[grpc]
  address = "{node.containerd_socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / "opt"}"

{cri}
  sandbox_image = "{PAUSE_IMAGE}"
  # this host gives no process CAP_SYS_RESOURCE, so none may lower its
  # oom_score_adj (kubelet asks -998 for sandboxes): keep containers at
  # containerd's own value or above, as containerd does for rootless nodes
  restrict_oom_score_adj = true
  enable_cdi = false
{cri[:-1]}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
{cri[:-1]}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
{cri[:-1]}.containerd.runtimes.runc.options]
  SystemdCgroup = false
{cri[:-1]}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{node.dir / "cni"}"
"""
    path = base / "config.toml"
    write_atomically(path, text, mode=0o644)
    return path


def _cni_config(node: Node) -> None:
    conf = {
        "cniVersion": "1.0.0",
        "name": "moorage-e2e",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.dir / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    (node.dir / "cni").mkdir(parents=True, exist_ok=True)
    conflist = node.dir / "cni" / "10-moorage-e2e.conflist"
    write_atomically(conflist, json.dumps(conf, indent=2), mode=0o644)


def _kubelet_config(layout: Layout, node: Node) -> Path:
    p = layout.pki
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        # each node's pods under a cgroup of its own: two kubelets share this host
        "cgroupRoot": f"/{node.cgroup_root}",
        "failSwapOn": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(p / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(p / f"kubelet-serving-{node.name}.crt"),
        "tlsPrivateKeyFile": str(p / f"kubelet-serving-{node.name}.key"),
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "volumePluginDir": str(node.dir / "volume-plugins"),
        # each node's container logs apart: a kubelet removes the pod log
        # directories of pods it does not run, another node's included
        "podLogsDir": str(node.dir / "pod-logs"),
        "resolvConf": str(node.dir / "resolv.conf"),
        # the host's disk is shared with everything else on it: never evict or
        # collect the locally imported images for it
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
    }
    path = node.dir / "kubelet.json"
    write_atomically(path, json.dumps(config, indent=2), mode=0o644)
    resolv = "# no cluster DNS in moorage's e2e cluster\n"
    write_atomically(node.dir / "resolv.conf", resolv, mode=0o644)
    return path


def _proxy_config(node: Node) -> Path:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(node.dir / "kube-proxy.kubeconfig")},
        "hostnameOverride": node.name,
        "mode": "iptables",
        "clusterCIDR": POD_NETWORK,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # host-wide sysctls are not ours to change
        "conntrack": {"maxPerCore": 0, "min": 0},
    }
    path = node.dir / "kube-proxy.json"
    write_atomically(path, json.dumps(config, indent=2), mode=0o644)
    return path


def ctr(node: Node, *args: str, timeout: float = CTR_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``ctr`` against the node's containerd; its exit status is the caller's to read."""
    return hosttools.run(
        ["ctr", f"--address={node.containerd_socket}", "--namespace=k8s.io", *args],
        timeout=timeout,
        ok=range(256),
    )


CGROUP_ROOT = Path("/sys/fs/cgroup")


def v1_hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies kubelet's cgroupfs driver writes to."""
    return [h for h in sorted(CGROUP_ROOT.iterdir()) if h.is_dir() and h.name != "unified"]


def make_cgroup_root(node: Node) -> None:
    """The node's cgroup root in every hierarchy (kubelet wants it to exist)."""
    for hierarchy in v1_hierarchies():
        root = hierarchy / node.cgroup_root
        root.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":  # an empty cpuset admits no task
            for key in ("cpuset.cpus", "cpuset.mems"):
                if not (root / key).read_text().strip():
                    (root / key).write_text((hierarchy / key).read_text())


def make_mount_namespace(layout: Layout, node: Node) -> None:
    """A later node's own mount namespace: its kubelet directory and plugin state.

    The chart gives every node the same host paths (/var/lib/kubelet, the
    plugin's state directory); on one machine the second kubelet gets its
    own by bind mounts inside a mount namespace pinned by a file.
    """
    pin = node.mount_ns
    if pin is None or _pinned(pin):
        return
    pin.parent.mkdir(parents=True, exist_ok=True)
    # `unshare --mount=FILE` needs FILE on a mount that does not propagate
    if str(pin.parent) not in _mount_points():
        hosttools.run(["mount", "--bind", str(pin.parent), str(pin.parent)], timeout=MOUNT_TIMEOUT)
    hosttools.run(["mount", "--make-private", str(pin.parent)], timeout=MOUNT_TIMEOUT)
    pin.touch()
    kubelet = node.dir / "kubelet"
    state = node.dir / "csi-state"
    for d in (kubelet, state, layout.kubelet_dir, layout.csi_state_dir):
        d.mkdir(parents=True, exist_ok=True)
    # shared inside the namespace: the plugin's Bidirectional mount of it needs
    # that; the first node's kubelet directory (a shared bind mount on the
    # host, copied here as a private one) is taken away first, or the runtime
    # finds that copy under node-b's and calls the directory not shared
    script = (
        f"{{ ! mountpoint -q {layout.kubelet_dir} || umount -R {layout.kubelet_dir}; }} && "
        f"mount --bind {kubelet} {layout.kubelet_dir} && "
        f"mount --make-rshared {layout.kubelet_dir} && "
        f"mount --bind {state} {layout.csi_state_dir} && "
        # no copy of another program's mounts under /tmp may stay pinned here
        f"{sys.executable} -m moorage_dev.devcluster.nodeinit --drop-mounts"
    )
    hosttools.run(
        ["unshare", f"--mount={pin}", "--propagation", "private", "sh", "-c", script],
        timeout=MOUNT_TIMEOUT,
    )


def _mount_points() -> list[str]:
    return [e.mount_point for e in read_mountinfo()]


def _pinned(pin: Path) -> bool:
    return pin.exists() and str(pin) in _mount_points()


def start_containerd(layout: Layout, node: Node) -> None:
    node.dir.mkdir(parents=True, exist_ok=True)
    config = _containerd_config(node)
    _cni_config(node)
    name = f"containerd-{node.name}"
    procs.start(
        layout,
        name,
        ["containerd", f"--config={config}"],
        netns=node.netns,
        inside=init_pid(layout, node),
    )
    procs.wait_for(
        f"{name} socket",
        lambda: ctr(node, "version", timeout=10).returncode == 0,
        timeout=60,
        log=layout.logs / f"{name}.log",
        alive=lambda: procs.running(layout, name),
    )


def archive_image(archive: Path) -> tuple[str, str] | None:
    """(name, manifest digest) an OCI archive carries (``io.containerd.image.name``)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        index = json.load(member) if member else {}
    for manifest in index.get("manifests", []):
        name = manifest.get("annotations", {}).get("io.containerd.image.name")
        if name:
            return str(name), str(manifest["digest"])
    return None


def images(node: Node) -> dict[str, str]:
    """name -> digest of the images in the node's containerd."""
    out = ctr(node, "images", "ls").stdout.splitlines()[1:]
    return {line.split()[0]: line.split()[2] for line in out if line.strip()}


def import_images(node: Node, archives: list[Path]) -> dict[str, str]:
    """Import (and unpack) every archive whose image is missing or differs; the images now."""
    present = images(node)
    for archive in archives:
        carried = archive_image(archive)
        if carried is not None and present.get(carried[0]) == carried[1]:
            continue
        result = ctr(node, "images", "import", str(archive))
        if result.returncode != 0:
            raise procs.ClusterError(f"ctr images import {archive}: {result.stderr.strip()}")
    return images(node)


def start_kubelet(layout: Layout, node: Node, tools: Tools) -> None:
    config = _kubelet_config(layout, node)
    name = f"kubelet-{node.name}"
    procs.start(
        layout,
        name,
        [
            tools.kube("kubelet"),
            f"--config={config}",
            f"--kubeconfig={node.dir / 'kubelet.kubeconfig'}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.address}",
            f"--root-dir={layout.kubelet_dir}",
            f"--cert-dir={node.dir / 'kubelet-pki'}",
        ],
        netns=node.netns,
        inside=init_pid(layout, node),
    )


def start_proxy(layout: Layout, node: Node, tools: Tools) -> None:
    config = _proxy_config(node)
    procs.start(
        layout,
        f"kube-proxy-{node.name}",
        [tools.kube("kube-proxy"), f"--config={config}"],
        netns=node.netns,
        inside=init_pid(layout, node),
    )

"""The control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler."""

from __future__ import annotations

from moorage_dev.devcluster import pki, procs
from moorage_dev.devcluster.kube import Kube
from moorage_dev.devcluster.layout import (
    API_PORT,
    CONTROL_ADDRESS,
    CONTROL_NS,
    KUBERNETES_SERVICE,
    POD_NETWORK,
    SERVICE_NETWORK,
    Layout,
)
from moorage_dev.devcluster.tools import Tools

DAEMONS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"]


def certificates(layout: Layout) -> None:
    p = layout.pki
    pki.ca(p)
    pki.issue(
        p,
        pki.Identity(
            "kube-apiserver",
            "kube-apiserver",
            ips=(CONTROL_ADDRESS, "127.0.0.1", KUBERNETES_SERVICE),
            dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
        ),
    )
    for who in (
        pki.Identity("admin", "moorage-e2e-admin", "system:masters"),
        pki.Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"),
        pki.Identity("kube-controller-manager", "system:kube-controller-manager"),
        pki.Identity("kube-scheduler", "system:kube-scheduler"),
    ):
        pki.issue(p, who)
    local = f"https://127.0.0.1:{API_PORT}"
    pki.kubeconfig(layout.admin_kubeconfig, p, "admin", local)
    for component in ("kube-controller-manager", "kube-scheduler"):
        pki.kubeconfig(layout.root / f"{component}.kubeconfig", p, component, local)


def up(layout: Layout, tools: Tools) -> None:
    p = layout.pki
    etcd_dir = layout.root / "etcd"
    procs.start(
        layout,
        "etcd",
        [
            str(tools.etcd),
            "--name=moorage-e2e",
            f"--data-dir={etcd_dir}",
            "--listen-client-urls=http://127.0.0.1:2379",
            "--advertise-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=moorage-e2e=http://127.0.0.1:2380",
            "--listen-metrics-urls=http://127.0.0.1:2381",
            "--log-level=warn",
        ],
        netns=CONTROL_NS,
    )
    procs.start(
        layout,
        "kube-apiserver",
        [
            tools.kube("kube-apiserver"),
            "--etcd-servers=http://127.0.0.1:2379",
            f"--advertise-address={CONTROL_ADDRESS}",
            "--bind-address=0.0.0.0",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={p}/kube-apiserver.crt",
            f"--tls-private-key-file={p}/kube-apiserver.key",
            f"--client-ca-file={p}/ca.crt",
            f"--service-cluster-ip-range={SERVICE_NETWORK}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={p}/sa.pub",
            f"--service-account-signing-key-file={p}/sa.key",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={p}/apiserver-kubelet-client.crt",
            f"--kubelet-client-key={p}/apiserver-kubelet-client.key",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
        ],
        netns=CONTROL_NS,
    )
    kube = Kube(layout, tools)
    procs.wait_for(
        "kube-apiserver /readyz",
        kube.ready,
        timeout=120,
        log=layout.logs / "kube-apiserver.log",
        alive=lambda: procs.running(layout, "kube-apiserver"),
    )
    common = [
        f"--authentication-kubeconfig={layout.root}/{{who}}.kubeconfig",
        f"--authorization-kubeconfig={layout.root}/{{who}}.kubeconfig",
        f"--kubeconfig={layout.root}/{{who}}.kubeconfig",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--profiling=false",
    ]
    procs.start(
        layout,
        "kube-controller-manager",
        [
            tools.kube("kube-controller-manager"),
            *(a.format(who="kube-controller-manager") for a in common),
            f"--service-account-private-key-file={p}/sa.key",
            f"--root-ca-file={p}/ca.crt",
            f"--cluster-signing-cert-file={p}/ca.crt",
            f"--cluster-signing-key-file={p}/ca.key",
            "--use-service-account-credentials=true",
            "--controllers=*",
            f"--service-cluster-ip-range={SERVICE_NETWORK}",
            f"--cluster-cidr={POD_NETWORK}",
        ],
        netns=CONTROL_NS,
    )
    procs.start(
        layout,
        "kube-scheduler",
        [tools.kube("kube-scheduler"), *(a.format(who="kube-scheduler") for a in common)],
        netns=CONTROL_NS,
    )


def down(layout: Layout) -> None:
    for name in reversed(DAEMONS):
        procs.stop(layout, name)

"""The e2e cluster for the scenario tests (``make e2e``; docs/e2e.md).

The session brings the cluster up with ``moorage_dev.devcluster`` (or uses the
one ``moorage dev cluster up`` left running, and then leaves it up) and
takes it down at the end, failed tests or not.  Each test gets a namespace
of its own, deleted with everything in it (and its volumes) afterwards.
Every step is printed with the time since the session started.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from moorage_dev.devcluster import cluster as devcluster
from moorage_dev.devcluster import procs
from moorage_dev.devcluster.kube import Kube
from moorage_dev.devcluster.layout import NAMESPACE, Layout, Node
from moorage_dev.devcluster.tools import Tools

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "examples"
STARTED = time.monotonic()


def step(text: str) -> None:
    """One line with the time since the run started (``make e2e`` runs pytest with -s)."""
    print(f"[e2e {time.monotonic() - STARTED:7.1f} s] {text}", flush=True)


@dataclass
class Cluster:
    layout: Layout
    tools: Tools
    kube: Kube
    _token: Path | None = field(default=None, repr=False)

    @property
    def node(self) -> Node:
        return self.layout.nodes[0]

    def moorage(self, *args: str) -> str:
        """The moorage CLI against the storage node's API, from the node's network namespace."""
        if self._token is None:
            secret = self.kube.get("secret", "moorage-backend-token", NAMESPACE)
            import base64

            self._token = self.layout.root / "e2e-token"
            self._token.write_bytes(base64.b64decode(secret["data"]["token"]))
            self._token.chmod(0o600)
        sn = self.layout.storage_node
        group, *rest = args
        argv = [
            "nsenter", f"--net=/run/netns/{sn.netns}", "--",
            sys.executable, "-m", "moorage", group,
            f"--backend={sn.address}:7443", f"--token-file={self._token}", *rest,
        ]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise AssertionError(f"moorage {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def volumes(self) -> list[dict[str, Any]]:
        return list(json.loads(self.moorage("volume", "list", "--json")))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    layout = Layout()
    tools = Tools.from_env()
    already_up = procs.running(layout, "kube-apiserver")
    step("cluster: " + ("using the one already running" if already_up else "bringing it up"))
    try:
        kube = devcluster.up(layout, tools, report=step)
        yield Cluster(layout, tools, kube)
    finally:
        if not already_up and os.environ.get("MOORAGE_E2E_KEEP") != "1":
            step("cluster: taking it down")
            devcluster.down(layout, tools, report=step)


@dataclass
class Namespace:
    """A test's namespace and the kubectl verbs it needs."""

    name: str
    cluster: Cluster

    @property
    def kube(self) -> Kube:
        return self.cluster.kube

    def apply(self, manifest: str | list[dict[str, Any]] | dict[str, Any]) -> None:
        if isinstance(manifest, dict):
            manifest = [manifest]
        if not isinstance(manifest, str):
            for doc in manifest:
                _quick_to_stop(doc)
        text = manifest if isinstance(manifest, str) else "\n---\n".join(
            json.dumps(m) for m in manifest
        )  # fmt: skip
        self.kube("apply", "-n", self.name, "-f", "-", input=text)

    def example(self, name: str, edit: Callable[[dict[str, Any]], None] | None = None) -> None:
        """One of deploy/examples, as an operator would apply it (optionally edited)."""
        docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
        if edit is not None:
            for doc in docs:
                edit(doc)
        self.apply(docs)

    def get(self, kind: str, name: str | None = None) -> Any:
        return self.kube.get(kind, name, self.name)

    def delete(self, kind: str, name: str, wait: bool = True) -> None:
        self.kube("delete", kind, name, "-n", self.name, f"--wait={str(wait).lower()}",
                  "--timeout=180s")  # fmt: skip

    def exec(self, pod: str, *command: str) -> str:
        return self.kube("exec", "-n", self.name, pod, "--", *command)

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 180) -> None:
        try:
            self.kube.wait_until(what, check, timeout=timeout)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.events()}") from None
        step(what)

    def events(self) -> str:
        """What Kubernetes said in this namespace, for a failure's message."""
        out = self.kube.run(
            "get", "events", "-n", self.name, "--sort-by=.lastTimestamp", check=False
        )  # fmt: skip
        return "events:\n" + (out.stdout or out.stderr)

    def pod_running(self, name: str, timeout: float = 180) -> dict[str, Any]:
        def running() -> bool:
            pod = self.get("pod", name)
            return bool(pod and pod["status"].get("phase") == "Running")

        self.wait(f"pod {name} running", running, timeout)
        return dict(self.get("pod", name))

    def pods(self, selector: str) -> list[dict[str, Any]]:
        out = self.kube("get", "pods", "-n", self.name, "-l", selector, "-o", "json")
        return list(json.loads(out)["items"])

    def bound(self, claim: str, timeout: float = 180) -> dict[str, Any]:
        self.wait(
            f"pvc {claim} bound",
            lambda: (self.get("pvc", claim) or {}).get("status", {}).get("phase") == "Bound",
            timeout,
        )
        return dict(self.get("pvc", claim))


def _quick_to_stop(doc: dict[str, Any]) -> None:
    """busybox's sh ignores SIGTERM: without this each pod takes its 30 s grace to go."""
    spec = doc.get("spec", {})
    pod = spec if doc.get("kind") == "Pod" else spec.get("template", {}).get("spec")
    if isinstance(pod, dict):
        pod.setdefault("terminationGracePeriodSeconds", 1)


@pytest.fixture
def ns(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Namespace]:
    name = "e2e-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:50].strip("-")
    # one left by an earlier run may still be going
    cluster.kube.wait_until(
        f"namespace {name} free", lambda: cluster.kube.get("namespace", name) is None, 300
    )
    cluster.kube("create", "namespace", name)
    step(f"--- {request.node.name} (namespace {name})")
    space = Namespace(name, cluster)
    try:
        yield space
    finally:
        pvs = [
            pv["metadata"]["name"]
            for pv in cluster.kube.get("pv")["items"]
            if (pv["spec"].get("claimRef") or {}).get("namespace") == name
            and pv["spec"].get("persistentVolumeReclaimPolicy") == "Delete"
        ]
        cluster.kube.run("delete", "namespace", name, "--timeout=300s", check=False)
        cluster.kube.wait_until(
            f"volumes of {name} deleted",
            lambda: not {p["metadata"]["name"] for p in cluster.kube.get("pv")["items"]} & set(pvs),
            timeout=180,
        )
        step(f"namespace {name} and its volumes deleted")


def claim(
    name: str,
    storage_class: str,
    mode: str = "ReadWriteOnce",
    size: str = "1Gi",
    source: dict[str, str] | None = None,
    block: bool = False,
) -> dict[str, Any]:
    """A PersistentVolumeClaim manifest."""
    spec: dict[str, Any] = {
        "accessModes": [mode],
        "storageClassName": storage_class,
        "resources": {"requests": {"storage": size}},
    }
    if source:
        spec["dataSource"] = source
    if block:
        spec["volumeMode"] = "Block"
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": spec}  # fmt: skip


def busybox_pod(name: str, command: str, mounts: dict[str, str]) -> dict[str, Any]:
    """A busybox pod running ``command`` with each claim of ``mounts`` at its path."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "image": "busybox:1.35",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sh", "-c", command],
                    "volumeMounts": [{"name": c, "mountPath": p} for c, p in mounts.items()],
                }
            ],
            "volumes": [{"name": c, "persistentVolumeClaim": {"claimName": c}} for c in mounts],
        },
    }


FIO_IMAGE = "moorage-e2e-fio:3.33"
FIO_DEVICE = "/dev/xvda"


def fio_pod(claim_name: str) -> dict[str, Any]:
    """A pod named ``fio`` idling with the raw block claim ``claim_name`` at FIO_DEVICE;
    the scenarios run fio in it through ``ns.exec``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "fio"},
        "spec": {
            "containers": [
                {
                    "name": "fio",
                    "image": FIO_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", "3600"],
                    "volumeDevices": [{"name": "data", "devicePath": FIO_DEVICE}],
                }
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}],
        },
    }


def replicas_ready(ns: Namespace, deployment: str, count: int) -> None:
    def ready() -> bool:
        status = (ns.get("deployment", deployment) or {}).get("status", {})
        return bool(status.get("readyReplicas") == count)

    ns.wait(f"{count} replicas ready", ready)


def each_reads_the_others(ns: Namespace, pods: list[str], message: str) -> None:
    """Every pod reads every pod's /data/<name> and finds ``message``."""

    def reads(reader: str, writer: str) -> bool:
        return ns.exec(reader, "cat", f"/data/{writer}").strip() == message

    for reader in pods:
        for writer in pods:
            ns.wait(
                f"{reader} reads {writer}'s file",
                functools.partial(reads, reader, writer),
                timeout=60,
            )


def host_mounts() -> list[tuple[str, str, str]]:
    """(source, mount point, fs type) of the host's mount table."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, point, fstype, *_ = line.split()
        out.append((source, point.replace("\\040", " "), fstype))
    return out

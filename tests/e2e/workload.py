"""The workload of the restart scenarios: a pod writing a counter to a block and an NFS
volume five times a second, and the checks that it keeps writing (read from the host
through the pod's own mounts, so they need no kubelet) and that files written and read
through kubectl exec work on both volumes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Namespace, busybox_pod, claim, host_mounts, step

WRITER = (
    "i=0; while true; do i=$((i+1)); "
    "echo $i > /block/counter; echo $i > /shared/counter; sleep 0.2; done"
)


def workload() -> list[dict[str, Any]]:
    return [
        claim("block", "moorage-block"),
        claim("shared", "moorage-nfs", "ReadWriteMany"),
        # the workload: a counter written to both volumes, 5 times a second
        busybox_pod("worker", WRITER, {"block": "/block", "shared": "/shared"}),
    ]


def exec_io(ns: Namespace, tag: str) -> None:
    """Write and read a file on each volume through kubectl exec."""
    for d in ("/block", "/shared"):
        ns.exec("worker", "sh", "-c", f"echo {tag} > {d}/{tag} && sync")
        assert ns.exec("worker", "cat", f"{d}/{tag}").strip() == tag


def counters(uid: str) -> list[int]:
    """The workload's counters, read from the host through the pod's own mounts."""
    values = []
    for point in sorted(pod_mounts(uid)):
        for _ in range(20):  # the writer truncates, then writes
            text = Path(point, "counter").read_text().strip()
            if text:
                values.append(int(text))
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"{point}/counter stays empty")
    return values


def writing(uid: str, while_: str, hold: float = 0.0) -> None:
    """Both volumes' counters move on, seen from the host (needs no kubelet)."""
    before = counters(uid)
    time.sleep(hold)
    assert len(before) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        after = counters(uid)
        if all(a > b for a, b in zip(after, before, strict=True)):
            step(f"the workload kept writing both volumes {while_}: {before} -> {after}")
            return
    raise AssertionError(f"the workload stopped writing {while_}: {before} -> {counters(uid)}")


def pod_mounts(uid: str) -> set[str]:
    return {p for _, p, _ in host_mounts() if f"/pods/{uid}/volumes/kubernetes.io~csi/" in p}

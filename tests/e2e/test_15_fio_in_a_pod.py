"""Scenario 15: what a pod gets from a raw block claim, next to the export it is served from.

fio runs in a pod on a ``volumeMode: Block`` claim (libaio, ``--direct=1`` on
the device), then fio's nbd engine runs from the host on the storage node's
export of that same volume, in the network namespace of the pod's node (the
export is granted to that node's address only, and the storage node's address
is reached only from a namespace wired to the cluster's bridge).  The same
volume, not one of the same size: the same image in the same pool behind the
same export, so the ratio is what the node's path (the kernel nbd client, or
the FUSE block file and loop device on a node without nbd.ko) costs the pod,
and the pod's fio proves on the way that what it wrote is what the export
holds.

The figures and the ratios pod/host are printed, not asserted (issue 22's goal
is >= 0.5x): the test fails only if fio fails or the data read back differs.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

from tests.e2e.conftest import FIO_DEVICE, Cluster, Namespace, claim, fio_pod, step

SIZE = 1 << 30  # the claim's 1Gi
RUNTIME = 8  # seconds per timed run
ROUNDS = 2  # each workload: pod, host, then host, pod; the best of each side kept
# The node's path to the export, by the pod's device's major number.
DEVICE_KINDS = {7: "a loop device (the FUSE block file)", 43: "a kernel nbd device"}
# What fio writes in the pod and checks there, then checks again from the host.
VERIFY = [
    "--name=verify", "--rw=write", "--bs=64k", "--size=64m", "--verify=crc32c",
    "--verify_state_save=0",  # no state file left in the working directory
]  # fmt: skip


@dataclass(frozen=True)
class Workload:
    label: str
    unit: str  # IOPS or MB/s
    args: tuple[str, ...]


WORKLOADS = (
    Workload(
        "4 KiB randrw 50/50, QD32",
        "IOPS",
        ("--rw=randrw", "--rwmixread=50", "--bs=4k", "--iodepth=32", "--norandommap"),
    ),
    Workload("1 MiB sequential read, QD8", "MB/s", ("--rw=read", "--bs=1m", "--iodepth=8")),
    Workload("1 MiB sequential write, QD8", "MB/s", ("--rw=write", "--bs=1m", "--iodepth=8")),
)


def _report(out: str, what: str) -> dict[str, Any]:
    """The single job of fio's JSON report (fio's nbd engine says something first)."""
    job: dict[str, Any] = json.loads(out[out.index("{") :])["jobs"][0]
    assert job["error"] == 0, f"fio {what}: error {job['error']}"
    return job


def _figure(job: dict[str, Any], unit: str) -> float:
    """IOPS (read and write summed) or MB/s (10^6 bytes/s) of one fio job."""
    moved = job["read"]["io_bytes"] + job["write"]["io_bytes"]
    assert moved > 0, "fio moved no data"
    if unit == "IOPS":
        return float(job["read"]["iops"] + job["write"]["iops"])
    return float(job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / 1e6


class Fio:
    """The same fio jobs in the pod (libaio on the device) and on the host (nbd engine)."""

    def __init__(self, ns: Namespace, netns: str, uri: str) -> None:
        self.ns, self.netns, self.uri = ns, netns, uri

    def pod(self, *args: str) -> str:
        return self.ns.kube.run(
            "exec", "-n", self.ns.name, "fio", "--",
            "fio", f"--filename={FIO_DEVICE}", "--ioengine=libaio", "--direct=1",
            "--output-format=json", *args,
            timeout=RUNTIME + 240,
        ).stdout  # fmt: skip

    def host(self, *args: str) -> str:
        argv = [
            "ip", "netns", "exec", self.netns,
            "fio", "--ioengine=nbd", f"--uri={self.uri}", f"--size={SIZE}",
            "--output-format=json", *args,
        ]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=RUNTIME + 240)
        if result.returncode != 0:
            raise AssertionError(f"{argv} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def timed(self, side: str, workload: Workload) -> float:
        args = ["--name=bench", "--time_based", f"--runtime={RUNTIME}", *workload.args]
        out = self.pod(*args) if side == "pod" else self.host(*args)
        return _figure(_report(out, f"{workload.label} ({side})"), workload.unit)


def _export_uri(ns: Namespace, pv: str) -> str:
    (va,) = [
        v for v in ns.kube.get("volumeattachments")["items"]
        if v["spec"]["source"].get("persistentVolumeName") == pv
    ]  # fmt: skip
    meta = va["status"]["attachmentMetadata"]
    return f"nbd://{meta['host']}:{meta['port']}/{meta['exportName']}"


def test_fio_in_a_pod_against_fio_on_the_export(cluster: Cluster, ns: Namespace) -> None:
    ns.apply([claim("raw", "moorage-block", block=True), fio_pod("raw")])
    ns.bound("raw")
    pod = ns.pod_running("fio")
    node = next(n for n in cluster.layout.nodes if n.name == pod["spec"]["nodeName"])
    uri = _export_uri(ns, ns.get("pvc", "raw")["spec"]["volumeName"])
    size = int(ns.exec("fio", "blockdev", "--getsize64", FIO_DEVICE).strip())
    assert size == SIZE, size
    fio = Fio(ns, node.netns, uri)
    major = int(ns.exec("fio", "stat", "-L", "-c", "%t", FIO_DEVICE).strip(), 16)
    path = DEVICE_KINDS.get(major, f"a device of major {major}")
    step(f"pod on {node.name}, {FIO_DEVICE} is {path}")
    step(f"the host's fio reaches {uri} from {node.netns}")

    # Every block written once, so no run reads holes of the image.
    _report(fio.pod("--name=fill", "--rw=write", "--bs=1m", "--iodepth=8"), "fill")
    # Written and read back in the pod (fsynced at the end), then read back through
    # the export: the host's fio is on the pod's volume, and the data went through.
    _report(fio.pod(*VERIFY, "--do_verify=1", "--end_fsync=1"), "write and verify (pod)")
    _report(fio.host(*VERIFY, "--verify_only"), "verify what the pod wrote (host)")
    step("64 MiB written and verified by fio in the pod, verified again from the host")

    best: dict[tuple[str, str], float] = {}
    for workload in WORKLOADS:
        for r in range(ROUNDS):
            for side in ("pod", "host") if r % 2 == 0 else ("host", "pod"):
                figure = fio.timed(side, workload)
                key = (workload.label, side)
                best[key] = max(best.get(key, 0.0), figure)
                step(f"{workload.label}, {side}: {figure:,.0f} {workload.unit}")

    lines = [
        f"fio in a pod on a raw block claim ({path}) vs fio's nbd engine on the export "
        f"({node.name}, best of {ROUNDS}, {RUNTIME} s each; issue 22's goal >= 0.5x, "
        "not asserted)",
        "| workload | pod (libaio, direct) | host (fio nbd) | pod/host |",
        "|---|--:|--:|--:|",
    ]
    for workload in WORKLOADS:
        p, h = best[workload.label, "pod"], best[workload.label, "host"]
        lines.append(f"| {workload.label} ({workload.unit}) | {p:,.0f} | {h:,.0f} | {p / h:.2f}x |")
    print("\n" + "\n".join(lines) + "\n", flush=True)

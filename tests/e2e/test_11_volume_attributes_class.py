"""Scenario 11: a VolumeAttributesClass with an IOPS limit, applied to a bound block claim."""

from __future__ import annotations

import functools
import json
from typing import Any

from tests.e2e.conftest import FIO_DEVICE, Namespace, claim, fio_pod, step

LIMIT = 150


def _class(name: str, iops: int) -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "VolumeAttributesClass",
        "metadata": {"name": name},
        "driverName": "csi.moorage.dev",
        "parameters": {"iopsLimit": str(iops)},
    }


def _modified_to(ns: Namespace, name: str) -> bool:
    status = ns.get("pvc", "tuned")["status"]
    return bool(status.get("currentVolumeAttributesClassName") == name)


def _fio_iops(ns: Namespace) -> float:
    out = ns.exec(
        "fio", "fio", "--name=limit", f"--filename={FIO_DEVICE}", "--rw=randread", "--bs=4k",
        "--direct=1", "--invalidate=0", "--ioengine=libaio", "--iodepth=8",
        "--time_based", "--runtime=8",
        "--output-format=json",
    )  # fmt: skip
    report = out[out.index("{") :]  # fio may say something first
    return float(json.loads(report)["jobs"][0]["read"]["iops"])


def test_iops_limit_applied_and_lifted(ns: Namespace) -> None:
    limited, unlimited = f"{ns.name}-iops-{LIMIT}", f"{ns.name}-unlimited"
    ns.kube.apply(_class(limited, LIMIT))
    ns.kube.apply(_class(unlimited, 0))
    try:
        ns.apply(
            [
                claim("tuned", "moorage-block", block=True),
                fio_pod("tuned"),
            ]
        )
        ns.bound("tuned")
        ns.pod_running("fio")
        free = _fio_iops(ns)
        step(f"fio without a limit: {free:.0f} IOPS")
        assert free > 2 * LIMIT, "the volume is too slow to show a limit"

        for name, expect in ((limited, LIMIT), (unlimited, None)):
            ns.kube(
                "patch", "pvc", "tuned", "-n", ns.name, "--type=merge",
                "-p", json.dumps({"spec": {"volumeAttributesClassName": name}}),
            )  # fmt: skip
            ns.wait(f"claim modified to {name}", functools.partial(_modified_to, ns, name))
            iops = _fio_iops(ns)
            step(f"fio with {name}: {iops:.0f} IOPS")
            if expect is None:
                assert iops > 2 * LIMIT
            else:
                assert abs(iops - expect) <= 0.1 * expect, iops
    finally:
        ns.kube.run("delete", "namespace", ns.name, "--timeout=300s", check=False)
        ns.kube.run("delete", "volumeattributesclass", limited, unlimited, check=False)

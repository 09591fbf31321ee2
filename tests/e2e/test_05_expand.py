"""Scenario 5: a claim's request raised: ControllerExpand + NodeExpand, seen by df in the pod."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Namespace, busybox_pod, claim, step

GI = 1 << 30


def _df_bytes(ns: Namespace) -> int:
    # busybox df -k: "Filesystem 1K-blocks Used Available Use% Mounted on"
    line = ns.exec("grow-user", "df", "-k", "/data").strip().splitlines()[-1]
    return int(line.split()[-5]) * 1024


@pytest.mark.parametrize(
    ("storage_class", "mode"),
    # xfs: this host gives no process CAP_SYS_RESOURCE, which the kernel wants
    # for growing a mounted ext4 (the plugin says so: FAILED_PRECONDITION)
    [("moorage-block-xfs", "ReadWriteOnce"), ("moorage-nfs", "ReadWriteMany")],
)
def test_expansion_reaches_the_pod(ns: Namespace, storage_class: str, mode: str) -> None:
    ns.apply(
        [
            claim("grow", storage_class, mode),
            busybox_pod("grow-user", "sleep 3600", {"grow": "/data"}),
        ]
    )
    ns.bound("grow")
    ns.pod_running("grow-user")
    before = _df_bytes(ns)
    assert before < 1.1 * GI
    step(f"{storage_class}: df in the pod says {before / GI:.2f} GiB")
    ns.kube(
        "patch", "pvc", "grow", "-n", ns.name, "--type=merge",
        "-p", '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}',
    )  # fmt: skip
    ns.wait(
        "claim capacity 2Gi",
        lambda: ns.get("pvc", "grow")["status"].get("capacity", {}).get("storage") == "2Gi",
        timeout=180,
    )
    ns.wait("df in the pod shows the new size", lambda: _df_bytes(ns) > 1.5 * GI, timeout=180)
    step(f"{storage_class}: df in the pod says {_df_bytes(ns) / GI:.2f} GiB")

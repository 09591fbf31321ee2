"""What NodeGetInfo's count costs (``csi.attach.limits``), since kubelet asks for it
every ``nodeAllocatableUpdatePeriodSeconds`` (10 s at the least).

Run with ``make bench``, or alone: ``.venv/bin/python -m pytest -q -p no:randomly
tests/bench/test_volume_limit_bench.py -o addopts="" -s``.
``NodeService.volume_limit()`` in-process over a state directory of N records,
on both block paths, against this host's real ``/sys/block`` and
``/proc/meminfo``; the mean of 200 calls is printed.  Nothing is asserted about speed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from csi import attach
from csi.config import NodeConfig
from csi.node import NodeService
from csi.nodestate import NodeState, StagedVolume

pytestmark = [pytest.mark.bench]

CALLS = 200
PLANS = {
    "fuse-loop": attach.Plan("fuse-loop", "bench", None, "bench"),
    "kernel-nbd": attach.Plan("kernel-nbd", "bench", None, "bench"),
}


@pytest.mark.parametrize("records", [0, 100, 1000])
def test_the_cost_of_the_count(records: int, tmp_path: Path) -> None:
    state = NodeState(tmp_path / "state")
    state.create()
    for i in range(records):
        state.put(
            StagedVolume(volume_id=f"sn-a/v{i}", staging_path=f"/x/{i}", kind="nbd", access="mount")
        )
    print(f"\nload average {os.getloadavg()[0]:.2f}; {records} node records")
    for name, plan in PLANS.items():
        node = NodeService("node-a", "127.0.0.1", NodeConfig(), tmp_path / "state", plan=plan)
        assert node.volume_limit().ours == records
        start = time.perf_counter()
        for _ in range(CALLS):
            node.volume_limit()
        per_call = (time.perf_counter() - start) / CALLS
        print(f"  {name:10s} {per_call * 1e3:8.3f} ms per call")

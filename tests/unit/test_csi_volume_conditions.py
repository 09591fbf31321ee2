"""``moorage_csi_volumes_abnormal``: the node plugin's count of the volumes whose
condition it last reported abnormal, among those still staged."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from prometheus_client import CollectorRegistry

from csi.config import NodeConfig
from csi.errors import NotFound
from csi.node import NodeService
from csi.proto import csi_pb2 as pb
from csi.volumeconditions import ABNORMAL_METRIC, VolumeConditions, VolumeConditionsCollector

CONTEXT = cast(grpc.ServicerContext, None)  # the handlers never use it


def abnormal_count(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value(ABNORMAL_METRIC)
    assert value is not None, f"{ABNORMAL_METRIC} is not exposed"
    return value


@pytest.fixture
def node(tmp_path: Path) -> NodeService:
    service = NodeService("node-a", "127.0.0.1", NodeConfig(), tmp_path / "state")
    service.state.create()
    return service


@pytest.fixture
def registry(node: NodeService) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(VolumeConditionsCollector(node.conditions, node.state.has))
    return registry


def stats(node: NodeService, volume_id: str) -> Any:
    request = pb.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path="/somewhere")
    return node.NodeGetVolumeStats(request, CONTEXT)


def test_a_volume_reported_abnormal_is_counted_while_it_is_staged(
    node: NodeService, registry: CollectorRegistry
) -> None:
    assert abnormal_count(registry) == 0
    # an unreadable record: NodeGetVolumeStats answers with an abnormal condition
    record = node.state._path("sn-a:vol-1")
    record.write_text("{not json")
    assert stats(node, "sn-a:vol-1").volume_condition.abnormal
    assert abnormal_count(registry) == 1
    # unstaged (its record gone): no longer counted, and forgotten
    record.unlink()
    assert abnormal_count(registry) == 0
    record.write_text("{not json")
    assert abnormal_count(registry) == 0, "a volume staged again is counted when reported again"


def test_a_volume_reported_normal_again_is_no_longer_counted(tmp_path: Path) -> None:
    conditions = VolumeConditions()
    staged = {"sn-a:vol-1", "sn-a:vol-2"}
    registry = CollectorRegistry()
    registry.register(VolumeConditionsCollector(conditions, staged.__contains__))
    conditions.record("sn-a:vol-1", "/pods/a/vol", True)
    conditions.record("sn-a:vol-2", "/pods/b/vol", True)
    assert abnormal_count(registry) == 2
    conditions.record("sn-a:vol-1", "/pods/a/vol", False)
    assert abnormal_count(registry) == 1


def test_a_volume_with_one_broken_publication_of_two_stays_counted(tmp_path: Path) -> None:
    # kubelet asks per path, in turn; the count must not follow the last answer
    conditions = VolumeConditions()
    registry = CollectorRegistry()
    registry.register(VolumeConditionsCollector(conditions, lambda _: True))
    for _ in range(2):
        conditions.record("sn-a:vol-1", "/pods/a/vol", True)
        assert abnormal_count(registry) == 1
        conditions.record("sn-a:vol-1", "/pods/b/vol", False)
        assert abnormal_count(registry) == 1, "one broken publication: the volume is abnormal"
    # the broken one unpublished: kubelet asks no more about it, and it is forgotten
    conditions.forget("sn-a:vol-1", "/pods/a/vol")
    assert abnormal_count(registry) == 0
    conditions.forget("sn-a:vol-1", "/pods/b/vol")
    assert not conditions._abnormal


def test_a_refused_stats_call_records_nothing(node: NodeService) -> None:
    with pytest.raises(NotFound):
        stats(node, "sn-a:not-staged")
    assert node.conditions.abnormal(lambda _: True) == 0
    assert not node.conditions._abnormal


def test_the_metric_names_no_volume(node: NodeService, registry: CollectorRegistry) -> None:
    node.state._path("sn-a:secret-volume").write_text("{not json")
    stats(node, "sn-a:secret-volume")
    text = "\n".join(f"{s.name}{s.labels}" for family in registry.collect() for s in family.samples)
    assert "secret-volume" not in text
    assert abnormal_count(registry) == 1


def test_an_abnormal_answer_carries_usage_for_kubelet(node: NodeService) -> None:
    """kubelet throws away an answer with no usage before it reads the condition:
    the abnormal condition must come with a usage entry (zeros: nothing known)."""
    node.state._path("sn-a:vol-1").write_text("{not json")
    got = stats(node, "sn-a:vol-1")
    assert got.volume_condition.abnormal
    assert [(u.unit, u.total, u.used, u.available) for u in got.usage] == [
        (pb.VolumeUsage.BYTES, 0, 0, 0)
    ]


def test_a_mount_whose_server_is_away_is_abnormal_with_usage(
    node: NodeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NFS mount of a storage node gone past its I/O timeout: EIO (ENOENT of the
    path would be NOT_FOUND); abnormal, naming the path, and still a usage entry."""
    import errno

    def eio(volume_id: str, path: str) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(node.state, "get", lambda volume_id: None)
    monkeypatch.setattr(node, "_record_at", eio)
    got = stats(node, "sn-a:vol-1")
    assert got.volume_condition.abnormal
    assert "cannot be read: Input/output error" in got.volume_condition.message
    assert len(got.usage) == 1

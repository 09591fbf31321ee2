"""The node plugin's records and the paths it accepts, on real files (no mounts).

An unreadable record is named, never taken for "nothing there"; a path
outside kubelet's directory is refused before anything is recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csi import attach
from csi.errors import FailedPrecondition, InvalidArgument, NotFound
from csi.kubeletpaths import KubeletPaths, check_free, leave_alone, occupant
from csi.nodestate import NodeState, StagedVolume, UnreadableRecord
from fuse import blockdev

URI = "nbd://127.0.0.1:10809/vol-a@node-a"


# ---------------------------------------------------------------- node state


def test_an_unreadable_record_is_named_not_taken_for_nothing_staged(tmp_path: Path) -> None:
    state = NodeState(tmp_path)
    state.create()
    state.put(StagedVolume("vol-a", "/k/a", "nbd", "mount", uri=URI))
    state.put(StagedVolume("vol-b", "/k/b", "nfs", "mount"))
    damaged = next(p for p in state.volumes.glob("*.json") if "vol-b" in p.read_text())
    damaged.write_text('{"volume_id": "vol-b", "staging_path": ')

    with pytest.raises(UnreadableRecord) as e:
        state.get("vol-b")
    assert str(damaged) in str(e.value)
    records, unreadable = state.scan()
    assert [r.volume_id for r in records] == ["vol-a"]
    assert [u.path for u in unreadable] == [damaged]
    assert damaged.exists()  # left for the operator


@pytest.mark.parametrize("content", ["[]", '{"volume_id": "x"}', '{"published": 3}', "\xff"])
def test_records_of_the_wrong_shape_are_unreadable(tmp_path: Path, content: str) -> None:
    state = NodeState(tmp_path)
    state.create()
    (state.volumes / "0.json").write_text(content, errors="surrogateescape")
    assert state.all() == []
    assert len(state.scan()[1]) == 1


def test_records_are_written_whole_and_removed(tmp_path: Path) -> None:
    state = NodeState(tmp_path)
    state.create()
    record = StagedVolume("vol-a", "/k/a", "nbd", "mount", uri=URI)
    state.put(record)
    assert state.get("vol-a") == record
    assert [p.suffix for p in state.volumes.iterdir()] == [".json"]  # no temporary left
    state.remove("vol-a")
    state.remove("vol-a")
    assert state.get("vol-a") is None


# ---------------------------------------------------------------- attachment records


def _fuse_record(state_dir: Path, data: str) -> Path:
    directory = state_dir / blockdev.SUBDIR / blockdev._key(URI)
    (directory / blockdev.MOUNTPOINT).mkdir(parents=True)
    (directory / blockdev.RECORD).write_text(data)
    return directory / blockdev.RECORD


@pytest.mark.parametrize("data", ["{ torn", "[]", '{"state": "attached", "device": "/dev/loop9"}'])
def test_an_unreadable_fuse_attachment_record_is_reported_and_left(
    tmp_path: Path, data: str
) -> None:
    record = _fuse_record(tmp_path, data)
    report = blockdev.reconcile_attachments(tmp_path)
    assert len(report) == 1 and str(record) in report[0] and "unreadable" in report[0]
    assert record.read_text() == data  # not undone as a half-made attachment
    assert (record.parent / blockdev.MOUNTPOINT).is_dir()
    assert blockdev.list_attachments(tmp_path) == []
    problem = blockdev.record_problem(URI, tmp_path)
    assert problem is not None and str(record) in problem
    assert attach.block_attachment_problem(URI, tmp_path) == problem
    with pytest.raises(blockdev.UnreadableRecord):
        blockdev.attach_fuse_block(URI, tmp_path)
    with pytest.raises(blockdev.UnreadableRecord):
        blockdev.detach_fuse_block(URI, tmp_path)
    assert record.read_text() == data


def test_a_missing_fuse_record_is_still_a_half_made_attachment(tmp_path: Path) -> None:
    directory = tmp_path / blockdev.SUBDIR / blockdev._key(URI)
    (directory / blockdev.MOUNTPOINT).mkdir(parents=True)
    assert blockdev.record_problem(URI, tmp_path) is None
    assert blockdev.reconcile_attachments(tmp_path) == [
        f"{directory.name}: half-made attachment removed"
    ]
    assert not directory.exists()


def test_an_unreadable_kernel_attachment_record_is_reported(tmp_path: Path) -> None:
    kernel = tmp_path / "kernel-nbd"
    kernel.mkdir()
    (kernel / "nbd3.json").write_text(json.dumps({"device": "/dev/nbd3"}))  # no uri
    report = attach.reconcile_block_attachments(tmp_path)
    assert any(str(kernel / "nbd3.json") in line and "unreadable" in line for line in report)
    problem = attach.block_attachment_problem(URI, tmp_path)
    assert problem is not None and str(kernel / "nbd3.json") in problem
    assert (kernel / "nbd3.json").exists()


# ---------------------------------------------------------------- kubelet's paths


@pytest.fixture
def kubelet(tmp_path: Path) -> KubeletPaths:
    (tmp_path / "kubelet" / "pods").mkdir(parents=True)
    return KubeletPaths(tmp_path / "kubelet")


@pytest.mark.parametrize(
    "value", ["/", "/etc", "", "relative/path", "/a\0b", "KUBELET", "KUBELET/../outside"]
)
def test_paths_outside_kubelets_directory_are_invalid(kubelet: KubeletPaths, value: str) -> None:
    with pytest.raises(InvalidArgument):
        kubelet.check(value.replace("KUBELET", str(kubelet.root)), "target_path")


def test_a_link_out_of_kubelets_directory_is_invalid(kubelet: KubeletPaths, tmp_path: Path) -> None:
    (kubelet.root / "pods" / "link").symlink_to(tmp_path)
    with pytest.raises(InvalidArgument) as e:
        kubelet.check(str(kubelet.root / "pods" / "link" / "x"), "target_path")
    assert "outside" in e.value.message
    assert kubelet.check(str(kubelet.root / "pods" / "p" / "mount"), "target_path") == (
        kubelet.root / "pods" / "p" / "mount"
    )


def test_a_staging_path_must_be_a_directory(kubelet: KubeletPaths) -> None:
    (kubelet.root / "pods" / "file").write_text("x")
    for bad in ("file", "file/under-a-file"):
        with pytest.raises(InvalidArgument):
            kubelet.staging(str(kubelet.root / "pods" / bad))
    assert kubelet.staging(str(kubelet.root / "pods")) == kubelet.root / "pods"
    assert kubelet.staging(str(kubelet.root / "new")) == kubelet.root / "new"


def test_what_lies_at_an_unrecorded_path_is_named_and_left(kubelet: KubeletPaths) -> None:
    pods = kubelet.root / "pods"
    (pods / "file").write_text("x")
    (pods / "full").mkdir()
    (pods / "full" / "keep").write_text("x")
    (pods / "empty").mkdir()
    (pods / "blank").touch()
    assert occupant(pods / "file") == "a file"
    assert occupant(pods / "full") == "a directory that is not empty"
    assert occupant(pods / "empty") is None
    assert occupant(pods / "missing") is None
    with pytest.raises(NotFound):
        leave_alone(pods / "file", "volume v is not published there")
    leave_alone(pods / "empty", "volume v is not published there")
    leave_alone(pods / "missing", "volume v is not published there")
    with pytest.raises(FailedPrecondition):
        check_free(pods / "full", "target_path")
    with pytest.raises(FailedPrecondition):
        check_free(pods / "file", "target_path", file_ok=True)  # not empty
    check_free(pods / "blank", "target_path", file_ok=True)
    assert (pods / "file").read_text() == "x" and (pods / "full" / "keep").exists()


def test_a_mount_point_is_checked_without_looking_into_its_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stat-ing the root of a mount whose server is away waits for that server: the
    target of an unpublish is resolved through its parent and the mount table."""
    import os
    from types import SimpleNamespace

    from csi.mounts import table

    root = tmp_path / "kubelet"
    target = root / "pods" / "uid" / "volumes" / "mount"
    target.mkdir(parents=True)
    looked_into: list[str] = []
    real_realpath = os.path.realpath

    def realpath(path: object) -> str:
        looked_into.append(os.fspath(path))  # type: ignore[call-overload]
        return real_realpath(path)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(os.path, "realpath", realpath)
    entry = SimpleNamespace(mount_point=str(target))
    monkeypatch.setattr(table, "mount_entries", lambda: [entry])
    assert KubeletPaths(root).check(str(target), "target_path") == target
    assert table.mount_entry(target) is entry  # type: ignore[comparison-overlap]  # unmount asks it
    assert str(target) not in looked_into
    monkeypatch.setattr(table, "mount_entries", lambda: [])
    assert KubeletPaths(root).check(str(target), "target_path") == target
    assert str(target) in looked_into  # not a mount point: its own symlinks are resolved


@pytest.mark.parametrize("workers", [1, 4, "x"])
def test_detach_gives_the_fuse_process_its_whole_stop_before_sigkill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: object
) -> None:
    """A block-file process still in its final flush is not killed: detach waits
    its own worst-case stop (requests under way, the workers', the flush)."""
    from fuse import blockfile
    from fuse.process import ABANDON_AFTER

    record = {"uri": URI, "state": "attached", "pid": 4242, "pid_start": 7, "workers": workers}
    _fuse_record(tmp_path, json.dumps(record))
    waits: list[float] = []
    monkeypatch.setattr(blockdev, "_alive", lambda pid, start: (pid, start) == (4242, 7))
    monkeypatch.setattr(blockdev, "_stop_process", lambda pid, start, wait: waits.append(wait))

    assert blockdev.detach_fuse_block(URI, tmp_path)
    own_stop = ABANDON_AFTER + blockfile.FINAL_FLUSH_TIMEOUT
    if workers != 1:  # several processes, or a record that does not say: the longest
        own_stop += blockfile.WORKER_STOP_TIMEOUT
    assert len(waits) == 1 and waits[0] > own_stop

"""At the node plugin's start: node state records that do not match what exists.

Two kinds are repaired, and each repair is one line of the start report:

- a record of a stage at a path the plugin refuses today (``/``, a relative
  path, anything outside kubelet's directory), left by an older version that
  recorded before it checked: the record is removed, after its block
  attachment is detached if nothing mounts that device.  Nothing is ever
  unmounted on the say-so of such a record.
- a record of which nothing exists: not ephemeral, no pod target recorded,
  nothing mounted at its staging path, and no block attachment of its
  export (a stage that failed half way, or whose mounts a reboot took): the
  record is removed, so a later stage starts afresh and an unstage finds
  nothing to do.

Anything else that does not match (a mount or attachment gone under a
volume pods still use) is reported, not repaired: kubelet's next stage and
publish repair it.  An ephemeral volume's record is never removed here: it
names a volume on a storage node that unpublish deletes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from csi import attach, mounts, stage
from csi.errors import InvalidArgument
from csi.kubeletpaths import KubeletPaths
from csi.nodestate import NodeState, StagedVolume


def _attachment(record: StagedVolume, attach_dir: Path) -> attach.BlockAttachment | None:
    if not record.uri:
        return None
    return next((a for a in attach.list_block_attachments(attach_dir) if a.uri == record.uri), None)


def _invalid_path(record: StagedVolume, paths: KubeletPaths) -> str | None:
    try:
        paths.check(record.staging_path, "staging path")
    except InvalidArgument as e:
        return e.message
    return None


def _forget_invalid(record: StagedVolume, why: str, state: NodeState) -> str:
    """Remove the record of a stage at a refused path; detach its unused device."""
    what = f"volume {record.volume_id}: its record is of a stage at a refused path ({why})"
    a = _attachment(record, state.attach_dir)
    if a is not None:
        try:
            users = mounts.mounts_of_device(a.device)
        except mounts.FilesystemError as e:
            return f"{what}; its device {a.device} cannot be examined ({e}): left as it is"
        if users:
            where = ", ".join(u.mount_point for u in users)
            return f"{what}; its device {a.device} is mounted at {where}: left as it is"
        try:
            attach.detach_block(record.uri, state.attach_dir)
        except attach.AttachError as e:
            return f"{what}; detaching {a.device} failed ({e}): left as it is"
    state.remove(record.volume_id)
    detached = f", {a.device} detached" if a is not None else ""
    return f"{what}: record removed{detached}, nothing unmounted"


def nothing_exists(record: StagedVolume, attach_dir: Path) -> bool:
    """Whether nothing the record describes exists: not ephemeral, no pod target
    recorded, nothing mounted at its staging path, its export not attached."""
    if record.ephemeral or record.published:
        return False
    staging = Path(record.staging_path)
    if mounts.mount_entry(staging) is not None:
        return False
    if record.access == "block" and mounts.mount_entry(staging / stage.DEVICE_FILE) is not None:
        return False
    return _attachment(record, attach_dir) is None


@contextlib.contextmanager
def no_trace_of_failure(state: NodeState, volume_id: str) -> Iterator[None]:
    """Around a stage: if it fails, a record of which nothing exists is removed."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            record = state.get(volume_id)
            if record is not None and nothing_exists(record, state.attach_dir):
                state.remove(volume_id)
        raise


def repair(state: NodeState, paths: KubeletPaths) -> tuple[list[StagedVolume], list[str]]:
    """Repair what the module docstring says; the records kept, and one line per repair."""
    kept: list[StagedVolume] = []
    report: list[str] = []
    for record in state.all():
        why = _invalid_path(record, paths)
        if why is not None and record.ephemeral:
            report.append(
                f"ephemeral volume {record.volume_id}: its record names a refused path "
                f"({why}): left as it is (unpublish deletes it)"
            )
            kept.append(record)
        elif why is not None:
            report.append(_forget_invalid(record, why, state))
            if state.get(record.volume_id) is not None:
                kept.append(record)
        elif nothing_exists(record, state.attach_dir):
            state.remove(record.volume_id)
            report.append(
                f"volume {record.volume_id}: nothing of its stage at {record.staging_path} "
                "exists (a stage that failed half way, or a reboot): record removed"
            )
        else:
            kept.append(record)
    return kept, report

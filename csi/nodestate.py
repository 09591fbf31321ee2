"""What the node plugin has staged and published, kept on disk across restarts.

One JSON file per staged volume under ``STATE_DIR/volumes/``, named by a
digest of the volume id, replaced whole and durably
(``hostio.atomicfile``: a crash leaves the old record or the new one, never
half of one).  A record is written *before* the step it describes is taken
and updated after, so a plugin that restarts finds every attachment, mount
and bind it made, and unstage/unpublish can undo them.  A record that cannot
be read is :class:`UnreadableRecord`, never taken for "nothing staged": the
plugin reports it and leaves it for the operator.  The attachments
themselves are recorded by ``csi.attach`` under ``STATE_DIR/attach``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hostio.atomicfile import unlink_durably, write_atomically


@dataclass
class Publication:
    target_path: str
    read_only: bool
    pod: dict[str, str] = field(default_factory=dict)  # name, namespace, uid (podInfoOnMount)


@dataclass
class StagedVolume:
    volume_id: str
    staging_path: str
    kind: str  # "nbd" or "nfs"
    access: str  # "mount" or "block"
    uri: str = ""  # nbd: the export's URI
    device: str = ""  # nbd: the attached block device
    fs_type: str = ""  # nbd mount: ext4 or xfs
    nfs_source: str = ""  # nfs: SERVER:PATH
    read_only: bool = False
    ephemeral: bool = False  # made for one pod: staging_path is the pod's target
    storage_node: str = ""  # ephemeral: where it was made, and its id there
    backend_id: str = ""
    published: dict[str, Publication] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagedVolume:
        pubs = {k: Publication(**v) for k, v in dict(data.pop("published", {})).items()}
        return cls(**data, published=pubs)


class UnreadableRecord(Exception):
    """A node state file that exists but does not parse as a record."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"node state file {path} is unreadable ({reason}): nothing of it is undone "
            "or replaced; repair or remove the file"
        )
        self.path = path


def _parse(path: Path) -> StagedVolume:
    """The record in ``path``; FileNotFoundError, or :class:`UnreadableRecord`."""
    try:
        data = json.loads(path.read_bytes())
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return StagedVolume.from_dict(data)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise UnreadableRecord(path, str(e)[:200]) from e


class NodeState:
    """The records under ``state_dir``; nothing is touched until :meth:`create`."""

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir
        self.volumes = state_dir / "volumes"
        self.attach_dir = state_dir / "attach"

    def create(self) -> None:
        """Make the state directories (0700), if they are not there yet."""
        self.volumes.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.attach_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, volume_id: str) -> Path:
        return self.volumes / f"{hashlib.sha256(volume_id.encode()).hexdigest()[:32]}.json"

    def get(self, volume_id: str) -> StagedVolume | None:
        """The volume's record; None if there is none; :class:`UnreadableRecord`."""
        try:
            record = _parse(self._path(volume_id))
        except FileNotFoundError:
            return None
        return record if record.volume_id == volume_id else None

    def put(self, record: StagedVolume) -> None:
        """Write the record, atomically and durably (the directory fsynced too)."""
        write_atomically(self._path(record.volume_id), record.to_json())

    def has(self, volume_id: str) -> bool:
        """Whether a record of ``volume_id`` is there (read or not)."""
        return self._path(volume_id).exists()

    def remove(self, volume_id: str) -> None:
        unlink_durably(self._path(volume_id), missing_ok=True)

    def scan(self) -> tuple[list[StagedVolume], list[UnreadableRecord]]:
        """Every record, and every file that is not one."""
        found: list[StagedVolume] = []
        unreadable: list[UnreadableRecord] = []
        for path in sorted(self.volumes.glob("*.json")):
            try:
                found.append(_parse(path))
            except FileNotFoundError:
                continue  # removed meanwhile
            except UnreadableRecord as e:
                unreadable.append(e)
        return found, unreadable

    def all(self) -> list[StagedVolume]:
        """Every readable record (:meth:`scan` also names the unreadable ones)."""
        return self.scan()[0]

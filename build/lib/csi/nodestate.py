"""What the node plugin has staged and published, kept on disk across restarts.

One JSON file per staged volume under ``STATE_DIR/volumes/``, named by a
digest of the volume id, written to a temporary name and renamed (a crash
leaves the old record or the new one, never half of one).  A record is
written *before* the step it describes is taken and updated after, so a
plugin that restarts finds every attachment, mount and bind it made, and
unstage/unpublish can undo them.  The attachments themselves are recorded
by ``csi.attach`` under ``STATE_DIR/attach``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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


class NodeState:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir
        self.volumes = state_dir / "volumes"
        self.attach_dir = state_dir / "attach"
        self.volumes.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.attach_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, volume_id: str) -> Path:
        return self.volumes / f"{hashlib.sha256(volume_id.encode()).hexdigest()[:32]}.json"

    def get(self, volume_id: str) -> StagedVolume | None:
        try:
            data = json.loads(self._path(volume_id).read_text())
            record = StagedVolume.from_dict(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            raise OSError(f"node state of volume {volume_id} is unreadable: {e}") from e
        return record if record.volume_id == volume_id else None

    def put(self, record: StagedVolume, durable: bool = True) -> None:
        """Write the record.  ``durable=False`` skips the fsync, for updates whose
        loss in a crash is harmless (a pod target already unmounted, still listed)."""
        path = self._path(record.volume_id)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(record.to_json())
            if durable:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)

    def remove(self, volume_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(volume_id).unlink()

    def all(self) -> list[StagedVolume]:
        found = []
        for path in sorted(self.volumes.glob("*.json")):
            try:
                found.append(StagedVolume.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return found

    def by_path(self, path: str) -> tuple[StagedVolume, Publication | None] | None:
        """The volume staged at, or published to, ``path``."""
        for record in self.all():
            if record.staging_path == path:
                return record, None
            if path in record.published:
                return record, record.published[path]
        return None

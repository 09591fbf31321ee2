"""Images the catalog does not know: moved aside, reported, never deleted implicitly.

``POOL/quarantine/<kind>-<id>.img`` (kind ``volume`` or ``snapshot``).  The
start-up reconciliation moves an unknown image there (a rename within the
pool: nothing is copied, nothing lost); the operator lists them (``moorage
pool orphans``), records one as a volume again (``moorage volume adopt``) or
removes it with an explicit command (``moorage pool purge-orphan --yes``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from backend.api.errors import InvalidArgument, NotFound
from backend.filesystems import fs_type_of
from backend.pool import Pool
from hostio.atomicfile import fsync_directory, unlink_durably

log = logging.getLogger("moorage.backend.quarantine")

FOLDER = "quarantine"
_NAME = re.compile(r"(volume|snapshot)-([0-9a-f]{32})(?:\.(\d+))?\.img")


@dataclass(frozen=True)
class Orphan:
    """One quarantined image."""

    name: str  # the file name under POOL/quarantine
    kind: str  # "volume" or "snapshot": where it was found
    original_id: str
    size_bytes: int
    allocated_bytes: int
    fs_type: str | None  # xfs/ext4 when it holds one (an nfs volume's image)
    quarantined_at: float  # seconds since the epoch


def folder(pool: Pool) -> Path:
    return pool.root / FOLDER


def quarantine(pool: Pool, source: Path, kind: str, original_id: str) -> Path:
    """Move ``source`` into the quarantine folder under a name that is free."""
    target_dir = folder(pool)
    target_dir.mkdir(exist_ok=True)
    target = target_dir / f"{kind}-{original_id}.img"
    n = 1
    while target.exists():
        target = target_dir / f"{kind}-{original_id}.{n}.img"
        n += 1
    os.rename(source, target)  # same filesystem: atomic, and no data moves
    os.utime(target)  # mtime: when it was quarantined
    fsync_directory(target_dir)
    fsync_directory(source.parent)
    log.error(
        "%s image %s is not in the catalog: quarantined as %s (moorage pool orphans)",
        kind,
        original_id,
        target,
    )
    return target


def orphan_path(pool: Pool, name: str) -> Path:
    """The quarantined file ``name`` (a bare file name, as ``list_orphans`` gives it)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"{name[:80]!r} is not a quarantined image name (volume-<id>.img, snapshot-<id>.img)"
        )
    path = folder(pool) / name
    if not path.is_file():
        raise NotFound(f"no quarantined image {name}")
    return path


def list_orphans(pool: Pool) -> list[Orphan]:
    d = folder(pool)
    if not d.is_dir():
        return []
    found = []
    for path in sorted(d.iterdir()):
        m = _NAME.fullmatch(path.name)
        if m is None or not path.is_file():
            continue
        st = path.stat()
        found.append(
            Orphan(
                name=path.name,
                kind=m.group(1),
                original_id=m.group(2),
                size_bytes=st.st_size,
                allocated_bytes=st.st_blocks * 512,
                fs_type=fs_type_of(path),
                quarantined_at=st.st_mtime,
            )
        )
    return found


def count(pool: Pool) -> int:
    d = folder(pool)
    if not d.is_dir():
        return 0
    return sum(1 for p in d.iterdir() if _NAME.fullmatch(p.name))


def purge(pool: Pool, name: str) -> Orphan:
    """Delete one quarantined image: the only way moorage removes one."""
    path = orphan_path(pool, name)
    info = next(o for o in list_orphans(pool) if o.name == name)
    unlink_durably(path)
    log.warning("quarantined image %s purged on request (%d bytes)", name, info.size_bytes)
    return info

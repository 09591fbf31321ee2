"""Which catalog a pool belongs to: a pool id in both, checked before every start.

``pool init`` (and the first start of a fresh pair) writes a random pool id
into ``POOL/moorage-pool.json`` and into the catalog's ``pool_identity``
table.  ``backend serve`` then refuses to start when the two disagree, or when
the catalog is new or empty while the pool holds volume images: a catalog on
the wrong path, restored from an older backup or lost with a container's
layer would otherwise make the start-up reconciliation treat every volume as
unknown.  ``--claim-pool`` makes the operator's decision explicit: the
catalog takes the pool's id, and images it does not know are quarantined,
never deleted.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from backend.api.errors import FailedPrecondition
from backend.catalog.db import Catalog
from backend.catalog.models import PoolIdentity, Volume
from backend.pool import Pool
from hostio.atomicfile import write_atomically

log = logging.getLogger("moorage.backend.poolidentity")

MARKER = "moorage-pool.json"


@dataclass(frozen=True)
class IdentityCheck:
    """What the start found: the pool id in force and whether it was just written."""

    pool_id: str
    recorded_now: bool


def marker_path(pool_root: Path) -> Path:
    return Path(pool_root) / MARKER


def read_pool_id(pool_root: Path) -> str | None:
    """The id in the pool's marker, or None when the pool has none."""
    path = marker_path(pool_root)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise FailedPrecondition(f"unreadable pool marker {path}: {e}") from e
    value = data.get("pool_id") if isinstance(data, dict) else None
    if not isinstance(value, str) or len(value) != 32 or not value.isalnum():
        raise FailedPrecondition(f"pool marker {path} holds no valid pool_id")
    return value


def write_pool_id(pool_root: Path, pool_id: str) -> None:
    text = json.dumps({"pool_id": pool_id, "format": 1}, indent=2) + "\n"
    write_atomically(marker_path(pool_root), text, mode=0o644)


def catalog_pool_id(catalog: Catalog) -> str | None:
    with catalog.read_session() as s:
        row = s.scalars(select(PoolIdentity)).first()
        return row.pool_id if row is not None else None


def record_catalog_pool_id(catalog: Catalog, pool_id: str) -> None:
    with catalog.session() as s:
        for row in s.scalars(select(PoolIdentity)).all():
            s.delete(row)
        s.flush()
        s.add(PoolIdentity(pool_id=pool_id))


def new_pool_id() -> str:
    return uuid.uuid4().hex


def init_identity(pool_root: Path, catalog: Catalog | None = None) -> str:
    """``pool init``: give the pool an id (kept if it has one) and record it in ``catalog``.

    A catalog that already names another pool is left alone (FailedPrecondition).
    """
    pool_id = read_pool_id(pool_root) or new_pool_id()
    if catalog is not None:
        known = catalog_pool_id(catalog)
        if known is not None and known != pool_id:
            raise FailedPrecondition(
                f"the catalog belongs to pool {known}, not to {pool_root} ({pool_id})"
            )
    if read_pool_id(pool_root) is None:
        write_pool_id(pool_root, pool_id)
    if catalog is not None and catalog_pool_id(catalog) is None:
        record_catalog_pool_id(catalog, pool_id)
    return pool_id


def check_pool_identity(catalog: Catalog, pool: Pool, claim: bool = False) -> IdentityCheck:
    """Refuse to start on a pool and catalog that do not belong together.

    Pairs them when both are new (or written by a version without ids and
    consistent: the catalog knows volumes, or the pool holds none).  With
    ``claim`` the catalog takes the pool whatever it held before.
    """
    in_pool = read_pool_id(pool.root)
    in_catalog = catalog_pool_id(catalog)
    with catalog.read_session() as s:
        volumes = int(s.scalar(select(func.count()).select_from(Volume)) or 0)
    images = len(pool.list_volume_images())
    fix = (
        "pass --claim-pool to make this catalog the pool's "
        "(images it does not know are quarantined)"
    )
    if in_pool is not None and in_pool == in_catalog:
        return IdentityCheck(in_pool, recorded_now=False)
    if not claim:
        if in_pool is not None and in_catalog is not None:
            raise FailedPrecondition(
                f"pool {pool.root} is pool {in_pool} but the catalog belongs to pool "
                f"{in_catalog}: wrong --data-dir/--db-url or --pool? If this is right, {fix}"
            )
        if in_catalog is not None and in_pool is None:
            raise FailedPrecondition(
                f"the catalog belongs to pool {in_catalog} but {pool.root} has no "
                f"{MARKER}: is the pool's filesystem mounted? If this is right, {fix}"
            )
        if volumes == 0 and images > 0:
            raise FailedPrecondition(
                f"the catalog is new or empty but pool {pool.root} holds {images} volume "
                "images: wrong --data-dir/--db-url, or a lost catalog (restore its backup, "
                f"docs/backend.md)? If this is right, {fix}"
            )
    pool_id = in_pool or new_pool_id()
    if in_pool is None:
        write_pool_id(pool.root, pool_id)
    record_catalog_pool_id(catalog, pool_id)
    how = "claimed by" if claim and in_catalog != pool_id else "paired with"
    log.warning("pool %s (%s) %s this catalog", pool.root, pool_id, how)
    return IdentityCheck(pool_id, recorded_now=True)

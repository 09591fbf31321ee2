"""How every operation of the storage node starts and ends.

Each operation that changes something runs through ``Operations._operation``:
hold the locks of the objects it touches; under the catalog-wide decision lock,
in one transaction, check the request against the catalog and record the intent
(the row in its transitional state plus a pending journal entry); then, with
the intent committed, do the file, mount and export work (a ``finish_*``
method, each step idempotent) and close the journal entry.
``backend/reconcile.py`` re-runs the ``finish_*`` step of any operation a crash
interrupted.  The operations themselves live in ``volume_ops.py``,
``snapshot_ops.py`` and ``publication_ops.py``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.api.errors import InvalidArgument, ResourceExhausted
from backend.catalog.db import Catalog, finish_operation
from backend.catalog.models import Operation, OperationKind, Volume
from backend.exporting import Exporter, Exports
from backend.failpoints import failpoint
from backend.keylocks import KeyLocks
from backend.pool import Pool
from backend.views import capacity_info

T = TypeVar("T")


@dataclass(frozen=True)
class ServiceConfig:
    nbd_host: str = "127.0.0.1"
    nbd_port: int = 10809
    nbd_tls: bool = False
    nfs_server: str = "127.0.0.1"
    nfs_port: int = 2049
    mount_port: int = 20048
    overcommit_ratio: float = 1.0
    # Health is not ok while the pool's free space is under this share of it (0: never).
    low_space_percent: float = 10.0

    def __post_init__(self) -> None:
        if not 0.1 <= self.overcommit_ratio <= 100:
            raise InvalidArgument("overcommit ratio must be between 0.1 and 100")
        if not 0 <= self.low_space_percent <= 100:
            raise InvalidArgument("low space percent must be between 0 and 100")


@dataclass(frozen=True)
class Intent(Generic[T]):
    """What an operation decided: its answer, and the work left once the intent is
    committed (None: nothing left, e.g. the volume is already made or already gone)."""

    answer: T
    then: Callable[[], object] | None = None


def new_id() -> str:
    return uuid.uuid4().hex


class Operations:
    """The state every operation shares and the steps they all take."""

    def __init__(
        self, catalog: Catalog, pool: Pool, exporter: Exporter, config: ServiceConfig
    ) -> None:
        self.catalog = catalog
        self.pool = pool
        self.exporter = exporter
        self.config = config
        self.exports = Exports(pool, exporter, config.nbd_tls)
        # Decisions that read then write the catalog (capacity, names, export ids).
        self._decide = threading.Lock()
        self._locks = KeyLocks()

    def _operation(
        self, keys: Sequence[str], decide: Callable[[Session], Intent[T]], failpoint_at: str
    ) -> T:
        """The one way an operation starts.

        The locks of ``keys`` (object ids, names) are held for the whole
        operation.  ``decide`` runs under the decision lock in one catalog
        transaction: it checks the request against the catalog and records the
        intent.  Once that is committed, the failpoint ``failpoint_at`` and then the
        work the intent left run, still under the object locks.
        """
        with ExitStack() as held:
            for key in keys:
                held.enter_context(self._locks.hold(key))
            with self._decide, self.catalog.session() as s:
                intent = decide(s)
            if intent.then is not None:
                failpoint(failpoint_at)
                intent.then()
        return intent.answer

    def _check_capacity(self, s: Session, extra: int) -> None:
        cap = capacity_info(s, self.pool, self.config.overcommit_ratio)
        if extra > cap.available_bytes:
            raise ResourceExhausted(
                f"{extra} bytes requested but only {cap.available_bytes} available "
                f"(pool {cap.total_bytes} bytes x overcommit {cap.overcommit_ratio}, "
                f"{cap.provisioned_bytes} provisioned)"
            )

    def _close_journal(
        self, s: Session, target: str, *kinds: OperationKind, error: str | None = None
    ) -> None:
        """Mark the pending journal entry of ``target`` done (or failed with ``error``)."""
        op = self._pending_op(s, target, *kinds)
        if op is not None:
            finish_operation(op, error=error)

    def _pending_op(self, s: Session, target: str, *kinds: OperationKind) -> Operation | None:
        return s.scalars(
            select(Operation)
            .where(Operation.target_id == target, Operation.kind.in_(kinds))
            .where(Operation.state == "pending")
            .order_by(Operation.id.desc())
        ).first()

    def apply_exports(self, vol_id: str) -> None:
        """Make the exporter match the catalog for one volume (idempotent)."""
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                self.exports.apply(s, v)

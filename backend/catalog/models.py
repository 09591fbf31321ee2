"""The catalog's tables: volumes, snapshots, publications and the operation journal.

States are ``StrEnum`` members stored as their value strings in VARCHAR columns
(no native database enum, so adding a state never needs an ``ALTER TYPE``).
Every timestamp is timezone-aware UTC, whatever the database keeps.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Enum,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID_LENGTH = 32  # uuid4().hex
NAME_LENGTH = 128
STATE_LENGTH = 16

# Deterministic constraint names, the same on every database, so a later
# migration can name what it alters.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class VolumeType(enum.StrEnum):
    NBD = "nbd"
    NFS = "nfs"


class FsType(enum.StrEnum):
    XFS = "xfs"
    EXT4 = "ext4"


class VolumeState(enum.StrEnum):
    CREATING = "creating"
    READY = "ready"
    EXPANDING = "expanding"
    DELETING = "deleting"


class SnapshotState(enum.StrEnum):
    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


class PublicationState(enum.StrEnum):
    PUBLISHING = "publishing"
    PUBLISHED = "published"
    UNPUBLISHING = "unpublishing"


class OperationKind(enum.StrEnum):
    CREATE_VOLUME = "create_volume"
    DELETE_VOLUME = "delete_volume"
    EXPAND_VOLUME = "expand_volume"
    CREATE_SNAPSHOT = "create_snapshot"
    DELETE_SNAPSHOT = "delete_snapshot"
    CLONE_VOLUME = "clone_volume"
    PUBLISH = "publish"
    UNPUBLISH = "unpublish"
    # A quarantined image recorded as a volume again (backend/adoption_ops.py).
    ADOPT_VOLUME = "adopt_volume"
    # Several volumes' snapshots at one point in time (backend/group_snapshot_ops.py).
    CREATE_GROUP_SNAPSHOT = "create_group_snapshot"
    DELETE_GROUP_SNAPSHOT = "delete_group_snapshot"


class OperationState(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


DEFAULT_SQUASH = "root_squash"


def _string_enum(cls: type[enum.StrEnum], length: int = STATE_LENGTH) -> Enum:
    """A VARCHAR column holding the enum's values; loads as enum members."""
    return Enum(
        cls,
        native_enum=False,
        create_constraint=False,
        length=length,
        validate_strings=True,
        values_callable=lambda members: [m.value for m in members],
    )


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that only takes aware datetimes and returns UTC.

    SQLite keeps no zone, PostgreSQL returns the session's zone; both come back
    as UTC here. A naive datetime is refused rather than guessed at.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the catalog stores aware UTC times")
        value = value.astimezone(UTC)
        # SQLite would store the offset in the text; keep one form there.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Volume(Base):
    __tablename__ = "volumes"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    type: Mapped[VolumeType] = mapped_column(_string_enum(VolumeType))
    # The size asked for; the image of an nfs volume may be larger.
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    fs_type: Mapped[FsType | None] = mapped_column(_string_enum(FsType))
    squash: Mapped[str] = mapped_column(String(32), default=DEFAULT_SQUASH)
    parameters: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    labels: Mapped[dict[str, str] | None] = mapped_column(JSON, default=dict)
    # Plain ids, not foreign keys: a clone outlives the snapshot or volume it came from.
    source_snapshot_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    source_volume_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    state: Mapped[VolumeState] = mapped_column(
        _string_enum(VolumeState), default=VolumeState.CREATING
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # ganesha's Export_Id for an nfs volume: allocated once, stable for its life.
    nfs_export_id: Mapped[int | None] = mapped_column(Integer, unique=True)

    def __repr__(self) -> str:
        return (
            f"Volume(id={self.id!r}, name={self.name!r}, type={self.type!r}, state={self.state!r})"
        )


class Snapshot(Base):
    __tablename__ = "snapshots"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    # Not a foreign key: a snapshot survives the deletion of its source volume.
    source_volume_id: Mapped[str] = mapped_column(String(ID_LENGTH), index=True)
    volume_type: Mapped[VolumeType] = mapped_column(_string_enum(VolumeType))
    fs_type: Mapped[FsType | None] = mapped_column(_string_enum(FsType))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[SnapshotState] = mapped_column(
        _string_enum(SnapshotState), default=SnapshotState.CREATING
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # A member of a group snapshot: made and deleted with its group only.
    group_snapshot_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), index=True)

    def __repr__(self) -> str:
        return f"Snapshot(id={self.id!r}, name={self.name!r}, state={self.state!r})"


class GroupSnapshot(Base):
    """Snapshots of several volumes taken at one point in time; its members are
    the ``Snapshot`` rows that name it.  Its state is theirs (one transition for all)."""

    __tablename__ = "group_snapshots"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    # In the order asked for (the identity of the group, with the name).
    source_volume_ids: Mapped[list[str]] = mapped_column(JSON)
    state: Mapped[SnapshotState] = mapped_column(
        _string_enum(SnapshotState), default=SnapshotState.CREATING
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    def __repr__(self) -> str:
        return f"GroupSnapshot(id={self.id!r}, name={self.name!r}, state={self.state!r})"


class Publication(Base):
    """A volume made reachable by one node (an NBD export or an NFS client entry)."""

    __tablename__ = "publications"
    __table_args__ = (UniqueConstraint("volume_id", "node_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # A volume cannot be deleted while a publication row still names it.
    volume_id: Mapped[str] = mapped_column(ForeignKey("volumes.id"))
    node_id: Mapped[str] = mapped_column(String(128))
    node_address: Mapped[str] = mapped_column(String(64))
    read_only: Mapped[bool] = mapped_column(Boolean, default=False)
    # Several read-write publications of one nbd volume, when each asked for it.
    multi_writer: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    state: Mapped[PublicationState] = mapped_column(
        _string_enum(PublicationState), default=PublicationState.PUBLISHING
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    def __repr__(self) -> str:
        return (
            f"Publication(volume_id={self.volume_id!r}, node_id={self.node_id!r}, "
            f"state={self.state!r})"
        )


class Operation(Base):
    """The journal: intent recorded before the files change, completed after."""

    __tablename__ = "operations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[OperationKind] = mapped_column(_string_enum(OperationKind, length=32))
    target_id: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    state: Mapped[OperationState] = mapped_column(
        _string_enum(OperationState), default=OperationState.PENDING, index=True
    )
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    def __repr__(self) -> str:
        return (
            f"Operation(id={self.id!r}, kind={self.kind!r}, target_id={self.target_id!r}, "
            f"state={self.state!r})"
        )


class PoolIdentity(Base):
    """Which pool this catalog describes: one row, the id ``pool init`` or the
    first start wrote into the pool's ``moorage-pool.json`` (backend/poolidentity.py)."""

    __tablename__ = "pool_identity"

    pool_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

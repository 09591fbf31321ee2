"""Alembic environment of the catalog, online mode only.

``Catalog.migrate`` hands in its open connection as
``config.attributes["connection"]``; the ``alembic`` command line, given only
``sqlalchemy.url``, connects by itself. Logging is left alone: whoever runs
the migration owns it.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from backend.catalog.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no connection given and no sqlalchemy.url configured")
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            _run(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("the catalog migrations run online only")
run_migrations_online()

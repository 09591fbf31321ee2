"""Alembic environment and revisions of the catalog schema (run by ``Catalog.migrate``)."""

"""Catalog schema revisions, oldest first by down_revision."""

"""The storage node: its catalog, pool, exports, operations, API and daemon."""

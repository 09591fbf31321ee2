"""The catalog: what volumes, snapshots and publications exist (the source of truth)."""

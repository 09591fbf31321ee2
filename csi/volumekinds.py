"""The type (nbd or nfs) of each volume the controller has seen.

A volume's type never changes, so it is kept (the most recent
``KNOWN_KINDS`` volumes) and a publish needs no lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from backend.api.proto import backend_pb2 as bpb
from csi import messages

KNOWN_KINDS = 100_000  # volume id -> type, for publishes without a lookup


class VolumeKinds:
    def __init__(self) -> None:
        self._kinds: OrderedDict[str, str] = OrderedDict()
        self._kinds_lock = threading.Lock()

    def remember(self, volume_id: str, v: bpb.Volume) -> None:
        """A volume's type never changes: kept, so a publish needs no lookup."""
        with self._kinds_lock:
            self._kinds[volume_id] = messages.VOLUME_TYPES[v.type]
            self._kinds.move_to_end(volume_id)
            while len(self._kinds) > KNOWN_KINDS:
                self._kinds.popitem(last=False)

    def get(self, volume_id: str) -> str | None:
        with self._kinds_lock:
            return self._kinds.get(volume_id)

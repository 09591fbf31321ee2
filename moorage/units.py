"""Sizes as people write them: 512M, 10G, 1.5TiB, 4096, and Kubernetes' 20Gi."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
# binary multiples whatever the spelling: 10G, 10GB, 10GiB and Kubernetes' 10Gi
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(?:iB|i|B)?|B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 10G, 1TiB)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """1536 → '1.5KiB'; whole numbers lose their '.0'."""
    for unit in ("P", "T", "G", "M", "K"):
        scale = _UNITS[unit]
        if n >= scale:
            text = f"{n / scale:.1f}"
            return f"{text.removesuffix('.0')}{unit}iB"
    return f"{n}B"

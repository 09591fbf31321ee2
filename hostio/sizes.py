"""Sizes as people and Kubernetes write them, as a number of bytes.

Two spellings, one parser (:func:`parse_size`):

- **The command line's** (the default): a number, a fraction allowed, then
  an optional unit K, M, G, T or P, alone or followed by ``i``, ``B`` or
  ``iB``, or a bare ``B``; case and blanks do not matter.  Every unit is
  binary whatever the spelling: ``10G``, ``10GB``, ``10GiB`` and
  Kubernetes' ``10Gi`` are all 10 GiB (an operator sizing a pool thinks in
  GiB, and the chart's ``20Gi`` means the same).
- **Kubernetes'** (``kubernetes=True``, for what comes from a StorageClass
  or a pod's volume attributes): a resource quantity, case-sensitive, as
  the API server reads it.  ``Ki Mi Gi Ti Pi Ei`` are binary, ``k M G T P
  E`` decimal (``1G`` is 10⁹ bytes, not 2³⁰), ``m u n`` fractions, and an
  exponent is written ``1e9``; no blanks inside, no sign.  Every spelling the
  CSI parameters took before this parser (digits alone, or with ``Ki``,
  ``Mi``, ``Gi``, ``Ti``) means what it meant.

Either way the result must be a whole number of bytes (``1.5Ki`` is 1536;
``0.1Ki`` is refused); digits are ASCII only.  A refusal is ValueError.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_PEOPLE = re.compile(
    r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGTP])(?:iB|i|B)?|B)?\s*", re.IGNORECASE | re.ASCII
)
_KUBERNETES_SUFFIXES: dict[str, int | Fraction] = {
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_KUBERNETES = re.compile(
    r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)
_MAX_EXPONENT = 30  # past 1e30 bytes a quantity is a typing error, not a size


def parse_size(text: str, *, kubernetes: bool = False) -> int:
    """``text`` as a number of bytes, by the command line's or Kubernetes' spelling."""
    value = _kubernetes(text) if kubernetes else _people(text)
    if value.denominator != 1:
        raise ValueError(f"size {text[:40]!r} is not a whole number of bytes")
    return int(value)


def _people(text: str) -> Fraction:
    m = _PEOPLE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text[:40]!r} (examples: 4096, 512M, 10G, 1TiB)")
    return Fraction(m[1]) * _BINARY[(m[2] or "").upper()]


def _kubernetes(text: str) -> Fraction:
    m = _KUBERNETES.fullmatch(text.strip())
    if not m:
        raise ValueError(
            f"not a size: {text[:40]!r} (a Kubernetes quantity: 1073741824, 512Mi, 10Gi, 1G)"
        )
    number = Fraction(m[1] + ("0" if m[1].endswith(".") else ""))
    if m[2] is not None:
        exponent = int(m[2])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"size {text[:40]!r} is out of range")
        return number * Fraction(10) ** exponent
    return number * _KUBERNETES_SUFFIXES[m[3] or ""]


def format_size(n: int) -> str:
    """1536 → '1.5KiB'; whole numbers lose their '.0'."""
    for unit in ("P", "T", "G", "M", "K"):
        scale = _BINARY[unit]
        if n >= scale:
            text = f"{n / scale:.1f}"
            return f"{text.removesuffix('.0')}{unit}iB"
    return f"{n}B"

"""A Prometheus endpoint's samples as the tests read them: the text it serves, and each
sample's value by family and labels (the labels as exposed, in name order)."""

from __future__ import annotations

import re
import urllib.request


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text: str = r.read().decode()
    return text


def scrape(port: int) -> dict[str, float]:
    samples = {}
    for line in scrape_text(port).splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            samples[m[1]] = float(m[2])
    return samples


def value(samples: dict[str, float], family: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
    key = f"{family}{{{want}}}" if labels else family
    assert key in samples, f"{key} not in {sorted(k for k in samples if k.startswith(family))}"
    return samples[key]

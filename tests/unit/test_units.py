"""moorage.units: sizes as people (and Kubernetes) write them."""

from __future__ import annotations

import pytest

from moorage.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("100B", 100),
        ("512M", 512 << 20),
        ("10G", 10 << 30),
        ("10GB", 10 << 30),
        ("1TiB", 1 << 40),
        ("1.5K", 1536),
        # Kubernetes quantities, as the chart's loopPoolSize is written
        ("20Gi", 20 << 30),
        ("512Mi", 512 << 20),
        (" 8 gi ", 8 << 30),
    ],
)
def test_sizes_parsed(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "Gi", "8i", "iB", "8Gix", "-1G", "1.0000001K", "ten"])
def test_bad_sizes_refused_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_round_trips() -> None:
    for n in (1, 1536, 10 << 30, 3 << 40):
        assert parse_size(format_size(n)) == n

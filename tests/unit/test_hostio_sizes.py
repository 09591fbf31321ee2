"""hostio.sizes: sizes as the command line and Kubernetes write them.

The command line's spellings mean what ``moorage`` always took them to mean
(binary whatever the spelling); what comes from Kubernetes (StorageClass
parameters, an ephemeral volume's ``size``) is a Kubernetes quantity, so
``1G`` there is 10^9 bytes.  Every spelling the CSI copies took (digits, with
``Ki`` ``Mi`` ``Gi`` ``Ti``) means what it meant.
"""

from __future__ import annotations

import pytest

from csi import ephemeral, parameters
from csi.errors import InvalidArgument
from hostio.sizes import format_size, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("100B", 100),
        ("512M", 512 * MiB),
        ("10G", 10 * GiB),
        ("10GB", 10 * GiB),
        ("10GiB", 10 * GiB),
        ("1TiB", TiB),
        ("2P", 2 << 50),
        ("1.5K", 1536),
        ("0.5g", GiB // 2),
        # Kubernetes quantities, as the chart's loopPoolSize is written
        ("20Gi", 20 * GiB),
        ("512Mi", 512 * MiB),
        (" 8 gi ", 8 * GiB),
        ("9007199254740993", 2**53 + 1),  # exact: no float on the way
    ],
)
def test_command_line_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "Gi", "8i", "iB", "8Gix", "-1G", "+1G", "1.0000001K", "ten", "1e3", "١٢"]
)
def test_bad_command_line_sizes_are_refused_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        # what the CSI parameters took before, meaning the same
        ("100", 100),
        ("3Ki", 3 * KiB),
        ("100Mi", 100 * MiB),
        ("2Gi", 2 * GiB),
        ("1Ti", TiB),
        (" 64Mi ", 64 * MiB),
        # the rest of Kubernetes' quantities
        ("1G", 10**9),
        ("500M", 500 * 10**6),
        ("2k", 2000),
        ("1Pi", 1 << 50),
        ("1E", 10**18),
        ("1.5Gi", 3 * GiB // 2),
        (".5Ki", 512),
        ("1.", 1),
        ("1e3", 1000),
        ("1E3", 1000),  # an exponent, not exa
        ("5000e-3", 5),
        ("2000m", 2),
    ],
)
def test_kubernetes_quantities(text: str, size: int) -> None:
    assert parse_size(text, kubernetes=True) == size


@pytest.mark.parametrize(
    "text",
    ["", "Gi", "10gi", "10GB", "10 Gi", "-1", "+1", "1Zi", "1500m", "0.1Ki", "1e-3", "١٢", "1e31"],
)
def test_bad_kubernetes_quantities_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text, kubernetes=True)


def test_format_round_trips() -> None:
    for n in (1, 1536, 10 * GiB, 3 * TiB):
        assert parse_size(format_size(n)) == n
    assert format_size(1536) == "1.5KiB" and format_size(10 * GiB) == "10GiB"


def test_storage_class_limits_are_kubernetes_quantities() -> None:
    limits = parameters.check_mutable({"bandwidthLimit": "1G", "iopsLimit": "2k"})
    assert limits == {"bandwidthLimit": str(10**9), "iopsLimit": "2000"}
    assert parameters.check_mutable({"bandwidthLimit": "100Mi"}) == {
        "bandwidthLimit": str(100 * MiB)
    }
    with pytest.raises(InvalidArgument, match="Kubernetes quantity"):
        parameters.check_mutable({"bandwidthLimit": "100MB"})


def test_an_ephemeral_volume_size_is_a_kubernetes_quantity() -> None:
    assert ephemeral.parse({"size": "64Mi"}).size == 64 * MiB
    assert ephemeral.parse({}).size == GiB
    # 10^9 bytes, rounded up to whole MiB as every requested size is
    assert ephemeral.parse({"size": "1G"}).size == 954 * MiB
    with pytest.raises(InvalidArgument, match="size '1 Gi'"):
        ephemeral.parse({"size": "1 Gi"})

"""What the storage node accepts from callers, checked whole (issue 17).

Names and ids are matched in full (a trailing newline is not a second,
different name); a node's address passes one rule (``hostio/addresses.py``) that
the storage node's validation, ganesha's configuration model and the CSI
plugin all apply; and no message echoes more than a bounded part of its input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast
from unittest.mock import MagicMock

import pytest
from sqlalchemy import URL, select

from backend import validation
from backend.api.errors import InvalidArgument, Unavailable
from backend.catalog.db import Catalog, record_operation
from backend.catalog.models import (
    FsType,
    Operation,
    OperationKind,
    Publication,
    PublicationState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.ganesha.config import ExportConfig, client_address
from backend.ganesha.files import GaneshaFiles
from backend.operation import ServiceConfig
from backend.reconcile import reconcile
from backend.service import StorageService
from csi.config import ConfigError
from csi.config import node_address as csi_node_address
from csi.ids import parse_node_id, parse_object_id
from csi.requests import backend_name
from nbd.exports import Export, ExportError

HUGE = "k" * 10_000

# Every kind of address one node cannot be reached at, as issue 17 lists them.
BAD_ADDRESSES = {
    "unspecified-v4": "0.0.0.0",
    "unspecified-v6": "::",
    "zone": "fe80::1%eth0",
    "zone-with-syntax": 'fe80::1%a";}',
    "ipv4-mapped": "::ffff:10.77.0.12",
    "broadcast": "255.255.255.255",
    "multicast-v4": "224.0.0.1",
    "multicast-v6": "ff02::1",
    "quote": '"10.0.0.1"',
    "semicolon": "10.0.0.1;",
    "brace": "10.0.0.1}",
    "space": "10.0.0.1 ",
    "leading-space": " 10.0.0.1",
    "newline": "10.0.0.1\n",
    "tab": "10.0.0.1\t",
    "control": "10.0.0.1\x00",
    "name": "node.example.com",
    "empty": "",
    "non-ascii-digits": "\u0661\u0660.0.0.1",
    "huge": "1" * 10_000,
}

GOOD_ADDRESSES = {
    "127.0.0.1": "127.0.0.1",
    "::1": "::1",
    "10.77.0.12": "10.77.0.12",
    "192.168.1.20": "192.168.1.20",
    "8.8.8.8": "8.8.8.8",
    "fd00::12": "fd00::12",
    "2001:DB8::1": "2001:db8::1",
    "fe80::1": "fe80::1",
}


# ------------------------------------------------------------ whole matches


def test_names_ids_and_node_ids_are_matched_whole() -> None:
    assert validation.volume_name("evil") == "evil"
    assert validation.node_id("nodeb") == "nodeb"
    for suffix in ("\n", "\r\n", " ", "\x00"):
        for check, value in (
            (validation.volume_name, "evil"),
            (validation.node_id, "nodeb"),
            (validation.object_id, "0" * 32),
            (lambda key: validation.labels({key: "x"}), "app"),
        ):
            with pytest.raises(InvalidArgument):
                check(value + suffix)
                pytest.fail(f"{value + suffix!r} was accepted")


def test_other_packages_match_whole_too() -> None:
    # the CSI plugin's ids and names
    assert parse_node_id("nodeb@10.0.0.1") is not None
    assert parse_node_id("nodeb\n@10.0.0.1") is None
    assert parse_object_id("sn-a:" + "0" * 32) is not None
    assert parse_object_id("sn-a:" + "0" * 32 + "\n") is None
    assert backend_name("pvc-1") == "pvc-1"
    assert backend_name("pvc-1\n") != "pvc-1\n"
    # an NBD export's name appears in logs and file names
    with pytest.raises(ExportError):
        Export(name="vol@nodeb\n", path="/dev/null")  # type: ignore[arg-type]


# ------------------------------------------------------------ node addresses


def refusals(bad: str) -> list[str]:
    """Which layers refuse ``bad``: the storage node's validation, ganesha's
    model (it renders no such client) and the CSI plugin (it neither starts
    with it nor publishes to it)."""
    refused = []
    for layer, check, error in (
        ("validation", validation.node_address, InvalidArgument),
        ("ganesha", client_address, InvalidArgument),
        ("csi", csi_node_address, ConfigError),
    ):
        try:
            check(bad)
        except error as e:
            message = str(e)
            assert "\n" not in message and len(message) < 300, (layer, message)
            refused.append(layer)
    return refused


def test_every_layer_refuses_the_same_bad_addresses_and_takes_the_good() -> None:
    got = {case: refusals(bad) for case, bad in BAD_ADDRESSES.items()}
    wrong = {
        case: layers for case, layers in got.items() if layers != ["validation", "ganesha", "csi"]
    }
    assert wrong == {}, f"bad addresses not refused by every layer: {wrong}"
    for good, canonical in GOOD_ADDRESSES.items():
        assert validation.node_address(good) == canonical
        assert client_address(good) == canonical
        assert csi_node_address(good) == canonical


def test_the_reason_is_said_in_one_line() -> None:
    def why(value: str) -> str:
        with pytest.raises(InvalidArgument) as info:
            validation.node_address(value)
        return str(info.value)

    assert "unspecified" in why("0.0.0.0") and "unspecified" in why("::")
    assert "zone" in why("fe80::1%eth0")
    assert "IPv4-mapped" in why("::ffff:10.77.0.12") and "10.77.0.12" in why("::ffff:10.77.0.12")
    assert "broadcast" in why("255.255.255.255")
    assert "multicast" in why("224.0.0.1")
    assert "not an IPv4 or IPv6 address" in why("node.example.com")
    assert "not an IPv4 or IPv6 address" in why("10.0.0.0/8")  # a network is no node


def test_a_csi_node_id_with_a_refused_address_is_recognised_but_not_publishable() -> None:
    from csi.ids import address_problem

    ref = parse_node_id("n@0.0.0.0")
    assert ref is not None
    assert "unspecified" in (address_problem(ref) or "")
    good = parse_node_id("n@127.0.0.1")
    assert good is not None and address_problem(good) is None


def test_ganesha_still_takes_networks_but_no_bad_single_client() -> None:
    export = ExportConfig(
        export_id=1,
        path="/srv/x",  # type: ignore[arg-type]
        pseudo="/volumes/x",
        clients=("10.0.0.0/8", "127.0.0.1"),
    )
    assert export.clients == ("10.0.0.0/8", "127.0.0.1")
    for bad in ("::ffff:10.0.0.1", "224.0.0.1", "255.255.255.255"):
        with pytest.raises(InvalidArgument):
            ExportConfig(export_id=1, path="/srv/x", pseudo="/volumes/x", clients=(bad,))  # type: ignore[arg-type]


# ------------------------------------------------------------ bounded echoes


def message_of(call: Callable[[], object]) -> str:
    with pytest.raises(InvalidArgument) as info:
        call()
    return str(info.value)


HUGE_INPUTS: list[Callable[[], object]] = [
    lambda: validation.parameters("nbd", {HUGE: "1"}),
    lambda: validation.parameters("nfs", {HUGE: "1"}),
    lambda: validation.parameters("nbd", {f"{i}{HUGE}": "1" for i in range(50)}),
    lambda: validation.mutable_parameters("nfs", {HUGE: "1", "fs_type": "xfs"}),
    lambda: validation.mutable_parameters("nbd", {HUGE: "1"}),
    lambda: validation.parameters("nbd", {"iops_limit": HUGE}),
    lambda: validation.parameters("nfs", {"fs_type": HUGE}),
    lambda: validation.labels({HUGE: "v"}),
    lambda: validation.labels({"app": HUGE}),
    lambda: validation.volume_name(HUGE),
    lambda: validation.node_id(HUGE),
    lambda: validation.object_id(HUGE),
    lambda: validation.node_address(HUGE),
]


def test_messages_echo_at_most_a_bounded_part_of_the_input() -> None:
    lengths = [len(message_of(call)) for call in HUGE_INPUTS]
    assert max(lengths) <= 400, lengths


def test_many_unknown_parameters_are_counted_not_listed() -> None:
    message = message_of(lambda: validation.parameters("nbd", {f"p{i}": "1" for i in range(50)}))
    assert "and 46 more" in message, message


# ------------------------------------------- validate, then record, then act


@pytest.fixture
def service(tmp_path: Path) -> Iterator[StorageService]:
    """A storage service on a real catalog (SQLite in tmp_path), a mock pool and
    a mock exporter; one nbd and one nfs volume ready in the catalog."""
    catalog = Catalog(URL.create("sqlite", database=str(tmp_path / "catalog.sqlite3")))
    catalog.migrate()
    pool = MagicMock(name="pool")
    pool.image_path.side_effect = lambda vol_id: tmp_path / f"{vol_id}.img"
    pool.export_dir.side_effect = lambda vol_id: tmp_path / "mnt" / vol_id / "export"
    exporter = MagicMock(name="exporter")
    with catalog.session() as s:
        s.add(
            Volume(
                id=NBD_ID,
                name="blk",
                type=VolumeType.NBD,
                size_bytes=MiB,
                parameters={},
                state=VolumeState.READY,
            )
        )
        s.add(
            Volume(
                id=NFS_ID,
                name="fs",
                type=VolumeType.NFS,
                size_bytes=64 * MiB,
                fs_type=FsType.XFS,
                parameters={},
                nfs_export_id=7,
                state=VolumeState.READY,
            )
        )
    try:
        yield StorageService(catalog, pool, exporter, ServiceConfig())
    finally:
        catalog.dispose()


MiB = 1 << 20
NBD_ID = "1" * 32
NFS_ID = "2" * 32


def rows(service: StorageService) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(volume, node, state) of every publication; state of every journal entry."""
    with service.catalog.session() as s:
        pubs = [(p.volume_id, p.node_id, p.state.value) for p in s.scalars(select(Publication))]
        ops = [o.state.value for o in s.scalars(select(Operation))]
    return pubs, ops


def row(
    vol_id: str, node: str, address: str, state: PublicationState, read_only: bool = False
) -> Publication:
    """A publication row as the catalog holds it (one an older version wrote, say)."""
    return Publication(
        volume_id=vol_id,
        node_id=node,
        node_address=address,
        read_only=read_only,
        multi_writer=False,
        state=state,
    )


def test_a_publish_refused_by_any_layer_is_refused_before_it_is_recorded(
    service: StorageService,
) -> None:
    for vol_id in (NBD_ID, NFS_ID):
        for bad in ("0.0.0.0", "::ffff:10.0.0.1", "224.0.0.1", "255.255.255.255"):
            with pytest.raises(InvalidArgument):
                service.publish_volume(vol_id, "n1", bad, read_only=False)
        with pytest.raises(InvalidArgument):
            service.publish_volume(vol_id, "nodeb\n", "10.0.0.1", read_only=False)
    assert rows(service) == ([], [])
    exporter = cast(MagicMock, service.exporter)
    exporter.add_nbd_export.assert_not_called()
    exporter.set_nfs_export.assert_not_called()


def test_a_publish_whose_exports_cannot_be_applied_is_withdrawn(service: StorageService) -> None:
    exporter = cast(MagicMock, service.exporter)
    exporter.add_nbd_export.side_effect = Unavailable("the NBD server is stopping")
    exporter.set_nfs_export.side_effect = Unavailable("ganesha refused the export configuration")
    for vol_id in (NBD_ID, NFS_ID):
        with pytest.raises(Unavailable):
            service.publish_volume(vol_id, "n1", "10.0.0.1", read_only=False)
    pubs, ops = rows(service)
    assert pubs == [] and ops == ["failed", "failed"]
    # nothing is left to block the retry, once the exporter works
    exporter.add_nbd_export.side_effect = None
    exporter.set_nfs_export.side_effect = None
    for vol_id in (NBD_ID, NFS_ID):
        service.publish_volume(vol_id, "n1", "10.0.0.1", read_only=False)
    pubs, ops = rows(service)
    assert sorted(pubs) == [(NBD_ID, "n1", "published"), (NFS_ID, "n1", "published")]
    assert ops == ["failed", "failed", "done", "done"]


def test_a_legacy_row_is_left_out_of_the_exports_and_can_be_unpublished(
    service: StorageService,
) -> None:
    with service.catalog.session() as s:
        for vol_id, node, address in ((NFS_ID, "old", "0.0.0.0"), (NBD_ID, "nodeb\n", "10.0.0.9")):
            s.add(row(vol_id, node, address, PublicationState.PUBLISHED, read_only=True))
    exporter = cast(MagicMock, service.exporter)
    # another node's publish renders the exports without the legacy rows
    service.publish_volume(NFS_ID, "n1", "10.0.0.1", read_only=False)
    config = exporter.set_nfs_export.call_args.args[0]
    assert (config.clients, config.ro_clients) == (("10.0.0.1",), ())
    service.publish_volume(NBD_ID, "n1", "10.0.0.1", read_only=False)
    assert [c.args[0].name for c in exporter.add_nbd_export.call_args_list] == [f"{NBD_ID}@n1"]
    # an invalid node id no row has is refused; the legacy rows go by their exact ids
    with pytest.raises(InvalidArgument):
        service.unpublish_volume(NBD_ID, "nodec\n")
    service.unpublish_volume(NBD_ID, "nodeb\n")
    service.unpublish_volume(NFS_ID, "old")
    pubs, _ = rows(service)
    assert sorted(pubs) == [(NBD_ID, "n1", "published"), (NFS_ID, "n1", "published")]


def test_the_start_finishes_an_interrupted_publish_as_publish_does(
    service: StorageService, tmp_path: Path
) -> None:
    """Publishes whose intent was recorded before a crash: the start-up
    reconciliation finishes each with publish's own step (its exports applied,
    its row published, its own journal entry closed), and withdraws the one a
    legacy row can never be exported for."""
    with service.catalog.session() as s:
        for vol_id, node, address in (
            (NBD_ID, "n1", "10.0.0.1"),
            (NFS_ID, "n2", "10.0.0.2"),
            (NFS_ID, "legacy", "0.0.0.0"),
        ):
            s.add(row(vol_id, node, address, PublicationState.PUBLISHING))
            record_operation(s, OperationKind.PUBLISH, vol_id, {"node": node})
    pool = cast(MagicMock, service.pool)
    pool.remove_partial_files.return_value = []
    pool.list_mounts.return_value = set()
    pool.list_volume_images.return_value = {NBD_ID, NFS_ID}
    pool.list_snapshot_images.return_value = set()
    pool.is_mounted.return_value = True

    repairs = reconcile(service, GaneshaFiles(tmp_path / "ganesha"))

    pubs, ops = rows(service)
    assert sorted(pubs) == [(NBD_ID, "n1", "published"), (NFS_ID, "n2", "published")]
    assert ops == ["done", "done", "failed"]  # each entry closed for its own node
    assert f"finished interrupted publish of {NFS_ID}" in repairs
    withdrawn = f"rolled back interrupted publish of {NFS_ID}: publication to 'legacy' withdrawn"
    assert any(line.startswith(withdrawn) for line in repairs), repairs
    exporter = cast(MagicMock, service.exporter)
    assert {c.args[0].name for c in exporter.add_nbd_export.call_args_list} == {f"{NBD_ID}@n1"}
    config = exporter.set_nfs_export.call_args.args[0]
    assert (config.clients, config.ro_clients) == (("10.0.0.2",), ())

"""csi.attach.reconnect.Reconnector's decisions, with the kernel faked (the real
reconnect runs in the kernel lane: tests/kernel/test_kernel_nbd_bounds.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi.attach import reconnect
from csi.attach.block import BlockAttachment
from nbd import client as nbd_client
from nbd import kernel as nbd_kernel
from nbd.constants import OptionReply

URI = "nbd://10.0.0.1:10809/vol@node"


class FakeMonitor:
    """No netlink here: the decisions are driven by hand."""

    def close(self) -> None:
        pass


@pytest.fixture
def reconnector(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> reconnect.Reconnector:
    monkeypatch.setattr(reconnect, "LinkDeadMonitor", FakeMonitor)
    monkeypatch.setattr(
        nbd_kernel, "probe_kernel_nbd", lambda load_module: type("S", (), {"family": 1})()
    )
    monkeypatch.setattr(
        reconnect, "kernel_attachments",
        lambda _: [BlockAttachment(device="/dev/nbd3", uri=URI, path="kernel-nbd")],
    )  # fmt: skip
    monkeypatch.setattr(reconnect, "kernel_connected", lambda device: True)
    reconnector = reconnect.Reconnector(tmp_path)
    reconnector.open()
    return reconnector


def test_a_dead_device_of_ours_is_retried_until_its_server_answers(
    reconnector: reconnect.Reconnector,
) -> None:
    tries: list[tuple[str, str]] = []

    def connect(device: str, uri: str) -> None:
        tries.append((device, uri))
        if len(tries) < 3:
            raise ConnectionRefusedError("no server yet")

    reconnector._connect = connect
    reconnector._note_dead([3, 7])  # nbd7 is not ours: left alone
    for _ in range(5):
        reconnector._try_pending()
    assert tries == [("/dev/nbd3", URI)] * 3
    assert reconnector._pending == {}


def test_a_definitive_refusal_ends_the_tries(reconnector: reconnect.Reconnector) -> None:
    tries: list[str] = []

    def connect(device: str, uri: str) -> None:
        tries.append(device)
        raise nbd_client.HandshakeError("no such export", reply=OptionReply.ERR_UNKNOWN)

    reconnector._connect = connect
    reconnector._note_dead([3])
    reconnector._try_pending()
    reconnector._try_pending()
    assert tries == ["/dev/nbd3"]


def test_a_device_detached_meanwhile_is_forgotten(
    reconnector: reconnect.Reconnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    reconnector._connect = lambda device, uri: pytest.fail("a detached device was reconnected")
    reconnector._note_dead([3])
    monkeypatch.setattr(reconnect, "kernel_connected", lambda device: False)
    reconnector._try_pending()
    assert reconnector._pending == {}

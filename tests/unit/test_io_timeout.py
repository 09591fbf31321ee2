"""How long I/O on a staged volume waits for a storage node that went away.

One bound, set in three places that must agree: the node plugin's
configuration (``[node] io_timeout``), a StorageClass's ``ioTimeout`` (kept
with the volume and handed back in its volume context), and what each
attach path is given (the FUSE block file's and FUSE NFS mount's
``--timeout``, the kernel nbd driver's timeouts, the kernel NFS client's
``soft,timeo,retrans``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as bpb
from csi import config, messages, parameters, stage
from csi.attach.nfs import kernel_timeout_options
from csi.errors import InvalidArgument
from fuse import nbdconnections, nfsmount


def test_every_default_is_the_same_bound() -> None:
    assert (
        config.DEFAULT_IO_TIMEOUT
        == nbdconnections.DEFAULT_IO_TIMEOUT
        == nfsmount.DEFAULT_IO_TIMEOUT
        == 120
    )
    assert config.MAX_IO_TIMEOUT == nbdconnections.MAX_IO_TIMEOUT == nfsmount.MAX_IO_TIMEOUT


def test_the_node_configuration_takes_io_timeout(tmp_path: Path) -> None:
    path = tmp_path / "csi.toml"
    path.write_text(
        '[[storage_nodes]]\nname = "sn"\naddress = "unix:/x"\n[node]\nio_timeout = 30\n'
    )
    assert config.load_config(path).node.io_timeout == 30.0
    path.write_text('[[storage_nodes]]\nname = "sn"\naddress = "unix:/x"\n')
    assert config.load_config(path).node.io_timeout == config.DEFAULT_IO_TIMEOUT
    for bad in ("0", "-5", "86401", '"fast"'):
        path.write_text(
            f'[[storage_nodes]]\nname = "sn"\naddress = "unix:/x"\n[node]\nio_timeout = {bad}\n'
        )
        with pytest.raises(config.ConfigError, match="io_timeout"):
            config.load_config(path)


def test_a_storage_class_io_timeout_is_checked_and_kept_with_the_volume() -> None:
    assert parameters.parse({"ioTimeout": "30"}, {}).io_timeout == "30"
    assert parameters.parse({"ioTimeout": "007"}, {}).io_timeout == "7"
    assert parameters.parse({}, {}).io_timeout == ""
    for bad in ("0", "86401", "1.5", "-1", "30s", "", "٣"):
        with pytest.raises(InvalidArgument, match="ioTimeout"):
            parameters.parse({"ioTimeout": bad}, {})
    v = bpb.Volume(id="v1", type=bpb.NBD, labels={messages.IO_TIMEOUT_LABEL: "30"})
    assert messages.volume("sn", v, []).volume_context["ioTimeout"] == "30"
    assert (
        "ioTimeout"
        not in messages.volume("sn", bpb.Volume(id="v2", type=bpb.NBD), []).volume_context
    )


def test_the_node_takes_the_volumes_io_timeout_else_its_own() -> None:
    assert stage.io_timeout({"ioTimeout": "30"}, 120.0) == 30.0
    assert stage.io_timeout({}, 120.0) == 120.0
    with pytest.raises(InvalidArgument):
        stage.io_timeout({"ioTimeout": "forever"}, 120.0)


def test_kernel_nfs_mounts_are_soft_with_a_bound_unless_the_class_says_otherwise() -> None:
    options = kernel_timeout_options(120.0, [])
    assert options[0] == "soft" and "retrans=2" in options
    timeo = int(next(o for o in options if o.startswith("timeo=")).split("=")[1])
    # over TCP the waits grow by timeo each time: timeo * (1 + 2 + 3) deciseconds in all
    assert timeo * 6 / 10 == pytest.approx(120.0, abs=1)
    for theirs in (["hard"], ["soft"], ["timeo=600"], ["retrans=5"], ["softerr"]):
        assert kernel_timeout_options(120.0, theirs) == []


def test_the_kernel_nbd_device_gets_half_the_bound_for_each_of_its_timeouts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A request unanswered for half the bound fails the connection; the device then
    waits the other half for a new one: I/O fails within the bound."""
    from csi.attach import block
    from nbd import client as nbd_client
    from nbd import kernel as nbd_kernel

    class Negotiated:
        class sock:
            @staticmethod
            def close() -> None:
                pass

    given: dict[str, object] = {}

    def attach_kernel(negotiated: object, **kwargs: object) -> str:
        given.update(kwargs)
        return "/dev/nbd3"

    monkeypatch.setattr(nbd_client, "connect_uri", lambda uri, timeout: Negotiated())
    monkeypatch.setattr(nbd_kernel, "attach_kernel", attach_kernel)
    device = block._attach_kernel("nbd://127.0.0.1:10809/v", tmp_path, 30.0, 120.0)
    assert device == "/dev/nbd3"
    assert given["io_timeout"] == 60 and given["dead_conn_timeout"] == 60

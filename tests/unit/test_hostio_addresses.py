"""hostio.addresses: one HOST:PORT rule, and every place a program takes one uses it.

Before it, five copies split on the last ':' with rules of their own: an IPv6
address without brackets was cut at its last group, port 0 (any free port)
was taken for an address to advertise or to serve metrics on, a metrics
address was not checked at all, and a host of '[::1' or 'a b' went through.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.api.errors import InvalidArgument
from backend.daemon import DaemonConfig, check_api_access, tcp_addresses
from csi.config import ConfigError, parse_config
from csi.server import EndpointError, host_port
from hostio.addresses import HostPort, HostPortError, parse_host_port


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:10809", "127.0.0.1", 10809),
        ("[::1]:10809", "::1", 10809),
        ("[fe80::1%eth0]:9000", "fe80::1%eth0", 9000),  # link-local, with its zone
        ("[::]:7443", "::", 7443),
        ("storage-a.moorage-system.svc:7443", "storage-a.moorage-system.svc", 7443),
        ("storage-a.example.:1", "storage-a.example.", 1),  # a fully qualified name
        ("localhost:65535", "localhost", 65535),
    ],
)
def test_hosts_and_ports_accepted(text: str, host: str, port: int) -> None:
    assert parse_host_port(text) == HostPort(host, port)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("localhost", "no ':PORT'"),
        ("localhost:", "the port must be a number from 1 to 65535"),
        ("[::1]", "no ':PORT' after the address"),
        ("[::1]10809", "no ':PORT' after the address"),
        ("[::1:10809", "no ']'"),
        ("::1:10809", "an IPv6 address goes in brackets"),  # "::1:10809" is an address itself
        ("[10.0.0.1]:80", "in brackets is not an IPv6 address"),
        ("[fe80::1%eth 0]:80", "in brackets is not an IPv6 address"),
        ("host:65536", "the port must be a number from 1 to 65535"),
        ("host:99999", "the port must be a number from 1 to 65535"),
        ("host:-1", "the port must be a number"),
        ("host:+80", "the port must be a number"),
        ("host: 80", "the port must be a number"),
        ("host:\uff18\uff10", "the port must be a number"),  # digits, but not ASCII ones
        ("host:0", "port 0, any free port"),
        (":7443", "no host"),
        ("a b:80", "not a host name or an IP address"),
        ("host/x:80", "not a host name or an IP address"),
        ("300.1.1.1:80", "not a host name or an IP address"),
        ("-lead.example:80", "not a host name or an IP address"),
    ],
)
def test_what_is_refused_says_why(text: str, why: str) -> None:
    with pytest.raises(HostPortError, match="is not HOST:PORT") as refused:
        parse_host_port(text, "--listen")
    assert str(refused.value).startswith(f"--listen {text!r} is not HOST:PORT (")
    assert why in str(refused.value)


def test_port_0_and_no_host_only_where_the_caller_asks_for_them() -> None:
    assert parse_host_port("127.0.0.1:0", allow_zero=True) == HostPort("127.0.0.1", 0)
    assert parse_host_port("[::1]:0", allow_zero=True) == HostPort("::1", 0)
    assert parse_host_port(":9810", allow_empty_host=True) == HostPort("", 9810)
    assert parse_host_port(":0", allow_zero=True, allow_empty_host=True) == HostPort("", 0)
    with pytest.raises(HostPortError, match="port 0"):
        parse_host_port(":0", allow_empty_host=True)
    with pytest.raises(HostPortError, match="no host"):
        parse_host_port(":0", allow_zero=True)
    with pytest.raises(HostPortError, match="from 0 to 65535"):
        parse_host_port("h:65536", allow_zero=True)


def test_a_host_and_port_are_written_back_with_brackets_for_ipv6() -> None:
    assert str(HostPort("::1", 10809)) == "[::1]:10809"
    assert str(HostPort("10.0.0.1", 80)) == "10.0.0.1:80"
    for text in ("[fe80::1%eth0]:9000", "name:1", "10.0.0.1:80"):
        assert str(parse_host_port(text)) == text


# ------------------------------------------------------------ the callers


def test_the_storage_node_takes_port_0_only_to_listen_for_nbd(tmp_path: Path) -> None:
    got = tcp_addresses(
        DaemonConfig(
            data_dir=tmp_path, nbd_listen=":0", nbd_advertise="[::1]:10809", metrics_listen=":9810"
        )
    )
    assert got.nbd_listen == HostPort("", 0)  # every address, any free port (advertised)
    assert got.nbd_advertise == HostPort("::1", 10809)
    assert got.metrics_listen == HostPort("", 9810)
    for flag, value in [
        ("nbd_advertise", "10.0.0.1:0"),  # clients cannot connect to port 0
        ("nbd_advertise", ":10809"),  # nor to no host
        ("metrics_listen", "0.0.0.0:0"),  # Prometheus would not find it
        ("metrics_listen", "[::1"),  # not checked at all before
        ("nbd_listen", "::1:10809"),
    ]:
        option = "--" + flag.replace("_", "-")
        config = DaemonConfig(data_dir=tmp_path)
        setattr(config, flag, value)
        with pytest.raises(InvalidArgument, match=f"{option} '.*' is not HOST:PORT"):
            tcp_addresses(config)


def test_the_storage_node_api_on_tcp_is_checked_by_the_same_rule(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-32-characters-or-so-x\n")
    token.chmod(0o600)
    for bad in ("127.0.0.1:0", "no-port-here", "[::1]:70000"):
        config = DaemonConfig(data_dir=tmp_path, listen=[bad], token_file=token)
        with pytest.raises(InvalidArgument, match=r"--listen .* is not HOST:PORT"):
            check_api_access(config)
    check_api_access(DaemonConfig(data_dir=tmp_path, listen=["[::1]:7443"], token_file=token))


def test_the_plugin_health_and_metrics_addresses_listen_on_every_address_without_a_host() -> None:
    assert host_port(":9808", "--health-address") == ("0.0.0.0", 9808)
    assert host_port("[::]:9808", "--health-address") == ("::", 9808)
    for bad in ("0.0.0.0", "127.0.0.1:0", "127.0.0.1:70000"):
        with pytest.raises(EndpointError, match=f"--health-address '{bad}' is not HOST:PORT"):
            host_port(bad, "--health-address")


def test_a_storage_node_address_in_the_plugin_config_needs_a_host_and_a_port() -> None:
    def config(address: str) -> object:
        return parse_config({"storage_nodes": [{"name": "sn-a", "address": address}]})

    for good in ("10.0.0.1:7443", "[fd00::1]:7443", "storage-a:7443", "unix:///run/b.sock"):
        config(good)
    for bad in (":7443", "10.0.0.1:0", "fd00::1:7443", "storage-a"):
        with pytest.raises(ConfigError, match="is not HOST:PORT"):
            config(bad)


def test_moorage_nbd_serve_listens_on_any_free_port_when_asked() -> None:
    typer = pytest.importorskip("typer")
    from moorage.nbd_cmd import parse_listen

    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen(":10809") == ("", 10809)
    with pytest.raises(typer.BadParameter, match="is not HOST:PORT"):
        parse_listen("::1:10809")

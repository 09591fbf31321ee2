"""NBD URIs (``nbd.uri``): what each scheme parses to, and what is refused."""

from __future__ import annotations

import pytest

from nbd.uri import NBD_DEFAULT_PORT, NBDURI, parse_nbd_uri


def test_parse_nbd_uri() -> None:
    assert parse_nbd_uri("nbd://example.com:10810/disk") == NBDURI(
        export_name="disk", tls=False, host="example.com", port=10810
    )
    assert parse_nbd_uri("nbds://10.0.0.1/vol%2Fa") == NBDURI(
        export_name="vol/a", tls=True, host="10.0.0.1", port=NBD_DEFAULT_PORT
    )
    assert parse_nbd_uri("nbd://[::1]:1234/") == NBDURI("", False, "::1", 1234)
    assert parse_nbd_uri("nbd://host") == NBDURI("", False, "host", NBD_DEFAULT_PORT)
    assert parse_nbd_uri("nbd://host//abs") == NBDURI("/abs", False, "host", NBD_DEFAULT_PORT)
    assert parse_nbd_uri("nbd+unix:///disk?socket=/run/nbd.sock") == NBDURI(
        export_name="disk", tls=False, socket_path="/run/nbd.sock"
    )
    assert parse_nbd_uri("nbds+unix:///?socket=/s&tls-certificates=/etc/pki") == NBDURI(
        export_name="", tls=True, socket_path="/s", query={"tls-certificates": "/etc/pki"}
    )
    for bad in (
        "http://host/disk",
        "nbd:///disk",
        "nbd+unix:///disk",
        "nbd+unix://host/disk?socket=/s",
        "nbd://host/disk?socket=/s",
        "nbd://host:port/disk",
        "nbd://user@host/disk",
        "nbd://host/disk#frag",
        "nbd://host/a%00b",
    ):
        with pytest.raises(ValueError):
            parse_nbd_uri(bad)

"""The ganesha configuration model: what it renders and what it refuses.

ganesha 4.3 segfaults on a syntax error at reload, so the property tests here
check that nothing the model accepts can render as anything but the intended
tokens, using the token patterns of ganesha's own lexer (conf_lex.l).
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.api.errors import InvalidArgument
from backend.ganesha.config import (
    CoreConfig,
    ExportConfig,
    client_address,
    render_export,
    render_main,
    safe_path,
)

# ganesha 4.3 conf_lex.l, transcribed: what its lexer reads as an address,
# a CIDR, and a %dir path.
_V4OCTET = r"[0-9]{1,3}"
_IPV4ADDR = rf"{_V4OCTET}\.{_V4OCTET}\.{_V4OCTET}\.{_V4OCTET}"
_H16 = r"[0-9A-Fa-f]{1,4}"
_LS32 = rf"(?:{_H16}:{_H16}|{_IPV4ADDR})"
_IPV6ADDR = "|".join(
    [
        rf"(?:{_H16}:){{6}}{_LS32}",
        rf"::(?:{_H16}:){{5}}{_LS32}",
        rf"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
        rf"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
        rf"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
        rf"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
        rf"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
        rf"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
        rf"(?:(?:{_H16}:){{0,6}}{_H16})?::",
    ]
)
GANESHA_V4_TOKEN = re.compile(rf"{_IPV4ADDR}(?:/(?:0|[1-9][0-9]?))?")
GANESHA_V6_TOKEN = re.compile(rf"(?:{_IPV6ADDR})(?:/(?:0|[1-9][0-9]{{0,2}}))?")
GANESHA_DIR_PATH = re.compile(r"/?[a-zA-Z0-9\-._]+(?:/[a-zA-Z0-9\-._*]+)*/?")

SYNTAX_CHARACTERS = set("\"'{};#=\\,\n\r\t\0 ") | {chr(c) for c in range(32)} | {"\x7f"}

CORE = CoreConfig(nfs_port=2049, recovery_root=Path("/var/lib/moorage/ganesha-recovery"))


def export(**overrides: Any) -> ExportConfig:
    fields: dict[str, Any] = {
        "export_id": 7,
        "path": Path("/srv/pool/mnt/0123abcd/export"),
        "pseudo": "/volumes/0123abcd",
        "clients": ("10.0.0.5", "192.168.1.0/24"),
    }
    fields.update(overrides)
    return ExportConfig(**fields)


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


# ------------------------------------------------------------------ rendering


def test_main_file_has_core_parameters_and_includes_only_conf_files() -> None:
    core = CoreConfig(
        nfs_port=12049,
        mount_port=12050,
        recovery_root=Path("/data/recovery"),
        grace_period=30,
        lease_lifetime=20,
        bind_addr="127.0.0.1",
    )
    text = render_main(core, Path("/etc/moorage/ganesha/exports.d"))
    got = lines(text)
    for expected in [
        "NFS_CORE_PARAM {",
        "NFS_Port = 12049;",
        "MNT_Port = 12050;",
        "Bind_addr = 127.0.0.1;",
        "Protocols = 3, 4;",
        "Enable_NLM = false;",
        "Enable_RQUOTA = false;",
        "Enable_UDP = false;",
        "Mount_Path_Pseudo = true;",
        "NFSv4 {",
        "Graceless = false;",
        "Grace_Period = 30;",
        "Lease_Lifetime = 20;",
        "RecoveryBackend = fs;",
        'RecoveryRoot = "/data/recovery";',
        "Only_Numeric_Owners = true;",
        "NFS_KRB5 {",
        "Active_krb5 = false;",
        "LOG {",
        "Default_Log_Level = EVENT;",
        "EXPORT_DEFAULTS {",
        "Access_Type = None;",
    ]:
        assert expected in got, expected
    assert got[-1] == '%dir "/etc/moorage/ganesha/exports.d/*.conf"'
    assert "dbus" not in text.lower()
    assert text.count("{") == text.count("}")


def test_main_file_without_mount_port_lets_ganesha_choose_it() -> None:
    assert not any(line.startswith("MNT_Port") for line in lines(render_main(CORE, Path("/e"))))


def test_v4_only_core_renders_one_protocol() -> None:
    core = CoreConfig(nfs_port=2049, recovery_root=Path("/r"), protocols=(4,), graceless=True)
    got = lines(render_main(core, Path("/e")))
    assert "Protocols = 4;" in got
    assert "Graceless = true;" in got


def test_export_grants_access_only_through_its_client_block() -> None:
    text = render_export(export(access="RO", squash="no_root_squash"))
    got = lines(text)
    assert got[1:12] == [
        "EXPORT {",
        "Export_Id = 7;",
        'Path = "/srv/pool/mnt/0123abcd/export";',
        'Pseudo = "/volumes/0123abcd";',
        "Protocols = 3, 4;",
        "Transports = TCP;",
        "Access_Type = None;",
        "Squash = no_root_squash;",
        "SecType = sys;",
        "Attr_Expiration_Time = 0;",  # the storage node changes attributes behind ganesha
        "FSAL {",
    ]
    client = got[got.index("CLIENT {") :]
    assert client == [
        "CLIENT {",
        "Clients = 10.0.0.5, 192.168.1.0/24;",
        "Access_Type = RO;",
        "}",
        "}",
    ]
    assert "Name = VFS;" in got
    assert text.count("{") == text.count("}") == 3


def test_export_with_no_clients_has_no_client_block_and_no_access() -> None:
    got = lines(render_export(export(clients=())))
    assert "CLIENT {" not in got
    assert [line for line in got if line.startswith("Access_Type")] == ["Access_Type = None;"]
    assert not any(line.startswith("Clients") for line in got)


def test_clients_are_canonicalised_and_deduplicated() -> None:
    e = export(clients=["10.0.0.5", "2001:DB8:0:0::1", "10.0.0.5", "2001:db8::/32"])
    assert e.clients == ("10.0.0.5", "2001:db8::1", "2001:db8::/32")


def test_paths_are_normalised() -> None:
    e = export(path="/srv/pool/", pseudo="/volumes/x/")
    assert e.path == Path("/srv/pool")
    assert e.pseudo == "/volumes/x"


# ------------------------------------------------------------------ refusals

BAD_PATHS = [
    "relative/path",
    "",
    "/",
    "//",
    "/srv/../etc",
    "/srv/./x",
    "/srv//x",
    '/srv/"quoted"',
    "/srv/it's",
    "/srv/{brace}",
    "/srv/}",
    "/srv/semi;colon",
    "/srv/new\nline",
    "/srv/carriage\rreturn",
    "/srv/tab\there",
    "/srv/hash#comment",
    "/srv/back\\slash",
    "/srv/with space",
    "/srv/nul\0byte",
    "/srv/équipe",
    "/srv/equals=sign",
    "/srv/comma,list",
    "/srv/star*",
    "/" + "a" * 256,
    "/" + "/".join(["abcdefgh"] * 120),
]


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_export_path_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        export(path=bad)


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_pseudo_path_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        export(pseudo=bad)


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_recovery_root_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        CoreConfig(nfs_port=2049, recovery_root=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_export_directory_in_main_file_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        render_main(CORE, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "10.0.0.1/33",
        "10.0.0.1/8",  # host bits set: which did you mean?
        "300.1.1.1",
        "10.0.0",
        "host.example.com",
        "*",
        "@netgroup",
        "0.0.0.0",  # ganesha reads this as "every client"
        "::",
        "fe80::1%eth0",
        "10.0.0.1; 10.0.0.2",
        "10.0.0.1,10.0.0.2",
        '"10.0.0.1"',
        "10.0.0.1\n",
        " 10.0.0.1",
        "10.0.0.1}",
        "2001:db8::/129",
        "\u0661\u0660.0.0.1",  # Arabic-Indic digits
    ],
)
def test_client_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        export(clients=(bad,))


def test_client_list_must_be_a_sequence_not_a_string() -> None:
    with pytest.raises(InvalidArgument):
        export(clients="10.0.0.1")


@pytest.mark.parametrize("bad", [0, 65535, 65536, -1, True, "1", 1.0])
def test_export_id_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        export(export_id=bad)


@pytest.mark.parametrize("good", [1, 65534])
def test_export_id_range_ends_are_accepted(good: int) -> None:
    assert export(export_id=good).export_id == good


@pytest.mark.parametrize(
    "overrides",
    [
        {"access": "rw"},
        {"access": "None"},
        {"access": "MDONLY"},
        {"squash": "none"},
        {"squash": "root_squash; Access_Type = RW"},
        {"protocols": ()},
        {"protocols": (2,)},
        {"protocols": (3, 3)},
        {"protocols": ("4",)},
        {"transports": ()},
        {"transports": ("RDMA",)},
        {"transports": ("TCP", "TCP")},
    ],
)
def test_export_options_outside_their_choices_are_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        export(**overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"nfs_port": 0},
        {"nfs_port": 65536},
        {"nfs_port": "2049"},
        {"mount_port": 0},
        {"mount_port": 2049},  # same as nfs_port
        {"grace_period": 181},
        {"lease_lifetime": 0},
        {"lease_lifetime": 121},
        {"grace_period": 10, "lease_lifetime": 20},
        {"protocols": (3, 4, 9)},
        {"bind_addr": "localhost"},
        {"bind_addr": "127.0.0.1; Enable_NLM = true"},
        {"bind_addr": "fe80::1%eth0"},
        {"log_level": "WARN"},
        {"log_level": "EVENT;"},
        {"graceless": "yes"},
    ],
)
def test_core_options_outside_their_ranges_are_refused(overrides: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"nfs_port": 2049, "recovery_root": Path("/r")}
    fields.update(overrides)
    with pytest.raises(InvalidArgument):
        CoreConfig(**fields)


def test_probe_host_is_loopback_for_a_wildcard_bind() -> None:
    assert CORE.probe_host == "127.0.0.1"
    assert CoreConfig(nfs_port=1, recovery_root=Path("/r"), bind_addr="::").probe_host == "::1"
    assert CoreConfig(nfs_port=1, recovery_root=Path("/r"), bind_addr="10.1.2.3").probe_host == (
        "10.1.2.3"
    )


# ------------------------------------------------------------------ properties

# The characters that matter, plus anything at all.
tricky_char = st.sampled_from(list("/._-aZ09\"'{};#=,\\ \n\r\t\0*%:[]@é\x7f"))
tricky_text = st.text(alphabet=tricky_char | st.characters(), max_size=40)
clean_path = st.lists(
    st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True), min_size=1, max_size=6
).map(lambda parts: "/" + "/".join(parts))
# a clean path with one tricky piece spliced in somewhere
spliced_path = st.builds(
    lambda path, at, piece: path[:at] + piece + path[at:],
    clean_path,
    st.integers(min_value=0, max_value=80),
    tricky_char,
)
path_like = st.one_of(
    spliced_path, spliced_path, clean_path, st.builds(lambda t: "/" + t, tricky_text), tricky_text
)


@settings(max_examples=1000)
@given(path_like)
def test_an_accepted_path_contains_no_syntax_character(text: str) -> None:
    try:
        path = safe_path(text, "path")
    except InvalidArgument:
        return
    rendered = str(path)
    assert not SYNTAX_CHARACTERS & set(rendered)
    assert rendered.isascii() and rendered.isprintable()
    assert ".." not in rendered.split("/")
    # and ganesha's %dir grammar reads it (with the pattern) as one path
    assert GANESHA_DIR_PATH.fullmatch(f"{rendered}/*.conf")


client_like = (
    st.ip_addresses().map(str)
    | st.builds(
        lambda a, p: f"{a}/{p}",
        st.ip_addresses(),
        st.integers(min_value=0, max_value=140),
    )
    | st.ip_addresses(v=6).map(lambda a: a.exploded)
    | tricky_text
)


@given(client_like)
def test_an_accepted_client_renders_as_an_address_token_of_ganeshas_lexer(text: str) -> None:
    try:
        client = client_address(text)
    except InvalidArgument:
        return
    assert not SYNTAX_CHARACTERS & set(client)
    network = ipaddress.ip_network(client, strict=False)
    token = GANESHA_V4_TOKEN if network.version == 4 else GANESHA_V6_TOKEN
    assert token.fullmatch(client), client


OPTION = re.compile(
    r'[A-Za-z_0-9]+ = (?:"[A-Za-z0-9._/-]+"|[A-Za-z0-9_.:/]+(?:, [A-Za-z0-9_.:/]+)*);'
)


@settings(max_examples=400)
@given(
    path=path_like,
    pseudo=path_like,
    clients=st.lists(client_like, max_size=4),
    access=st.sampled_from(["RW", "RO", "rw", "None; x"]),
    squash=st.sampled_from(["root_squash", "no_root_squash", "all_squash", "}"]),
    export_id=st.integers(min_value=-2, max_value=70000),
)
def test_an_accepted_export_renders_only_well_formed_lines(
    path: str, pseudo: str, clients: list[str], access: str, squash: str, export_id: int
) -> None:
    try:
        e = ExportConfig(
            export_id=export_id,
            path=Path(path) if path.startswith("/") else path,  # type: ignore[arg-type]
            pseudo=pseudo,
            clients=tuple(clients),
            access=access,  # type: ignore[arg-type]
            squash=squash,  # type: ignore[arg-type]
        )
    except InvalidArgument:
        return
    text = render_export(e)
    depth = 0
    for line in text.splitlines()[1:]:  # the first is the generated-by comment
        line = line.strip()
        if line.endswith(" {"):
            assert line in ("EXPORT {", "FSAL {", "CLIENT {")
            depth += 1
        elif line == "}":
            depth -= 1
            assert depth >= 0
        else:
            assert OPTION.fullmatch(line), line
    assert depth == 0
    assert "#" not in text.split("\n", 1)[1]

"""Wire compatibility of csi/proto/csi.proto with the CSI v1.13 spec.

The spec's ```protobuf blocks are concatenated into a .proto, both it and our
hand-written csi.proto are compiled with grpc_tools' protoc into descriptor sets,
and every wire-relevant part of the two descriptors is compared.
"""

from __future__ import annotations

import importlib.resources
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_IN_SHARED = Path("shared") / "reference" / "csi-spec-v1.13.md"


def _spec_path() -> Path:
    """The spec in shared/ beside this repository, or beside the one it was cloned from.

    A checkout made with ``git clone /path/to/main elsewhere`` has no shared/
    beside it; its origin does.
    """
    candidates = [REPO_ROOT.parent / SPEC_IN_SHARED]
    try:
        origin = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        origin = ""
    if origin.startswith("file://"):
        origin = origin[len("file://") :]
    if origin.startswith("/"):
        candidates.append(Path(origin).resolve().parent / SPEC_IN_SHARED)
    return next((c for c in candidates if c.is_file()), candidates[0])


SPEC_PATH = _spec_path()
OUR_PROTO = Path("csi") / "proto" / "csi.proto"
PACKAGE = "csi.v1"

_BLOCK_RE = re.compile(r"^```protobuf[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)

Summary = dict[str, Any]


# ------------------------------------------------------------------ building


def _compile(include_dir: Path, proto: str, out: Path) -> descriptor_pb2.FileDescriptorProto:
    """Compile one .proto into a descriptor set and return its FileDescriptorProto."""
    with importlib.resources.as_file(importlib.resources.files("grpc_tools") / "_proto") as wkt:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{include_dir}",
                f"-I{wkt}",
                f"--descriptor_set_out={out}",
                proto,
            ]
        )
    assert rc == 0, f"protoc failed (exit {rc}) on {include_dir / proto}; see stderr"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    files = [f for f in fds.file if f.name == proto]
    assert len(files) == 1, f"{proto} missing from descriptor set {[f.name for f in fds.file]}"
    return files[0]


@pytest.fixture(scope="module")
def spec_blocks() -> list[str]:
    if not SPEC_PATH.is_file():
        pytest.fail(
            f"CSI spec not found at {SPEC_PATH}: the wire-compatibility test needs "
            "shared/reference/csi-spec-v1.13.md beside the repository",
            pytrace=False,
        )
    blocks = _BLOCK_RE.findall(SPEC_PATH.read_text(encoding="utf-8"))
    assert blocks, f"no ```protobuf blocks found in {SPEC_PATH}"
    return blocks


@pytest.fixture(scope="module")
def spec_file(
    spec_blocks: list[str], tmp_path_factory: pytest.TempPathFactory
) -> descriptor_pb2.FileDescriptorProto:
    tmp = tmp_path_factory.mktemp("csi_spec")
    (tmp / "spec_csi.proto").write_text("\n".join(spec_blocks), encoding="utf-8")
    return _compile(tmp, "spec_csi.proto", tmp / "spec.pb")


@pytest.fixture(scope="module")
def our_file(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorProto:
    tmp = tmp_path_factory.mktemp("csi_ours")
    return _compile(REPO_ROOT, OUR_PROTO.as_posix(), tmp / "ours.pb")


# ----------------------------------------------------------------- summaries


def _opts(options: Any) -> bytes:
    """Options as bytes; csi.v1 custom options stay unknown fields, so this covers them."""
    return bytes(options.SerializeToString(deterministic=True))


def _walk_messages(
    prefix: str, messages: Any
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for msg in messages:
        name = f"{prefix}.{msg.name}"
        yield name, msg
        yield from _walk_messages(name, msg.nested_type)


def _walk_enums(
    file: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto]]:
    for enum in file.enum_type:
        yield f".{file.package}.{enum.name}", enum
    for msg_name, msg in _walk_messages(f".{file.package}", file.message_type):
        for enum in msg.enum_type:
            yield f"{msg_name}.{enum.name}", enum


def _messages(file: descriptor_pb2.FileDescriptorProto) -> Summary:
    out: Summary = {}
    for name, msg in _walk_messages(f".{file.package}", file.message_type):
        oneofs = [o.name for o in msg.oneof_decl]
        fields = frozenset(
            (
                f.name,
                f.number,
                f.type,
                f.label,
                f.type_name,
                oneofs[f.oneof_index] if f.HasField("oneof_index") else None,
                f.json_name,
                f.proto3_optional,
            )
            for f in msg.field
        )
        out[name] = {"fields": fields, "oneofs": frozenset(oneofs), "options": _opts(msg.options)}
    return out


def _field_options(file: descriptor_pb2.FileDescriptorProto) -> Summary:
    return {
        f"{name}.{f.name}": _opts(f.options)
        for name, msg in _walk_messages(f".{file.package}", file.message_type)
        for f in msg.field
    }


def _enums(file: descriptor_pb2.FileDescriptorProto) -> Summary:
    return {
        name: {
            "values": frozenset((v.name, v.number, _opts(v.options)) for v in enum.value),
            "options": _opts(enum.options),
        }
        for name, enum in _walk_enums(file)
    }


def _services(file: descriptor_pb2.FileDescriptorProto) -> Summary:
    return {
        f".{file.package}.{svc.name}": {
            "methods": frozenset(
                (
                    m.name,
                    m.input_type,
                    m.output_type,
                    m.client_streaming,
                    m.server_streaming,
                    _opts(m.options),
                )
                for m in svc.method
            ),
            "options": _opts(svc.options),
        }
        for svc in file.service
    }


def _extensions(file: descriptor_pb2.FileDescriptorProto) -> Summary:
    found = list(file.extension)
    for _, msg in _walk_messages(f".{file.package}", file.message_type):
        found.extend(msg.extension)
    return {e.name: (e.number, e.extendee, e.type, e.label, e.type_name) for e in found}


def _describe(key: str, spec: Any, ours: Any) -> list[str]:
    """Human-readable difference of one summary entry, narrowed to what differs."""
    if isinstance(spec, dict) and isinstance(ours, dict):
        return [
            line
            for part in sorted(spec.keys() | ours.keys())
            if spec.get(part) != ours.get(part)
            for line in _describe(f"{key} [{part}]", spec.get(part), ours.get(part))
        ]
    if isinstance(spec, frozenset) and isinstance(ours, frozenset):
        lines = [f"differs: {key}"]
        lines += [f"    spec only: {item!r}" for item in sorted(spec - ours, key=repr)]
        lines += [f"    ours only: {item!r}" for item in sorted(ours - spec, key=repr)]
        return lines
    return [f"differs: {key}\n    spec: {spec!r}\n    ours: {ours!r}"]


def _assert_same(what: str, spec: Summary, ours: Summary) -> None:
    problems = [f"missing from csi.proto: {k}" for k in sorted(spec.keys() - ours.keys())]
    problems += [f"not in the spec: {k}" for k in sorted(ours.keys() - spec.keys())]
    for key in sorted(spec.keys() & ours.keys()):
        if spec[key] != ours[key]:
            problems += _describe(key, spec[key], ours[key])
    if problems:
        pytest.fail(f"{what} mismatch:\n  " + "\n  ".join(problems), pytrace=False)


# --------------------------------------------------------------------- tests


def test_spec_extraction_is_complete(
    spec_blocks: list[str], spec_file: descriptor_pb2.FileDescriptorProto
) -> None:
    assert 'syntax = "proto3";' in spec_blocks[0]
    assert spec_file.package == PACKAGE
    assert ".csi.v1.CreateVolumeRequest" in _messages(spec_file)
    assert {s.name for s in spec_file.service} >= {"Identity", "Controller", "Node"}


def test_file_header_matches(
    spec_file: descriptor_pb2.FileDescriptorProto, our_file: descriptor_pb2.FileDescriptorProto
) -> None:
    assert our_file.package == spec_file.package == PACKAGE
    assert our_file.syntax == spec_file.syntax == "proto3"
    assert sorted(our_file.dependency) == sorted(spec_file.dependency)


def test_messages_match(
    spec_file: descriptor_pb2.FileDescriptorProto, our_file: descriptor_pb2.FileDescriptorProto
) -> None:
    _assert_same("message", _messages(spec_file), _messages(our_file))


def test_field_options_match(
    spec_file: descriptor_pb2.FileDescriptorProto, our_file: descriptor_pb2.FileDescriptorProto
) -> None:
    spec = _field_options(spec_file)
    assert any(spec.values()), "expected csi_secret/alpha_field options in the spec"
    _assert_same("field options", spec, _field_options(our_file))


def test_enums_match(
    spec_file: descriptor_pb2.FileDescriptorProto, our_file: descriptor_pb2.FileDescriptorProto
) -> None:
    _assert_same("enum", _enums(spec_file), _enums(our_file))


def test_services_match(
    spec_file: descriptor_pb2.FileDescriptorProto, our_file: descriptor_pb2.FileDescriptorProto
) -> None:
    _assert_same("service", _services(spec_file), _services(our_file))


def test_extensions_match(
    spec_file: descriptor_pb2.FileDescriptorProto, our_file: descriptor_pb2.FileDescriptorProto
) -> None:
    spec = _extensions(spec_file)
    assert {"csi_secret", "alpha_field", "alpha_message", "alpha_method"} <= spec.keys()
    _assert_same("extension", spec, _extensions(our_file))


def test_generated_stubs_round_trip() -> None:
    try:
        from csi.proto import csi_pb2, csi_pb2_grpc
    except ImportError as exc:
        pytest.fail(f"generated CSI stubs not importable ({exc}); run `make proto`", pytrace=False)

    req = csi_pb2.CreateVolumeRequest(name="x", secrets={"k": "v"})
    req.volume_capabilities.add().mount.fs_type = "ext4"
    again = csi_pb2.CreateVolumeRequest.FromString(req.SerializeToString())
    assert again == req
    assert again.name == "x"
    assert again.volume_capabilities[0].WhichOneof("access_type") == "mount"
    assert csi_pb2.DESCRIPTOR.package == PACKAGE

    for name in ("ControllerStub", "IdentityServicer", "NodeServicer"):
        assert hasattr(csi_pb2_grpc, name), f"csi_pb2_grpc.{name} missing"

"""Wire compatibility of csi/proto/pluginregistration.proto with kubelet's own.

kubelet's definition is read from the k8s.io/kubelet Go module at the
Kubernetes release the e2e cluster runs (fetched with ``go mod download``);
both files are compiled with grpc_tools' protoc and every wire-relevant part
is compared, and the full method names kubelet's generated Go client dials are
checked against ours.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from tests.conftest import REPO, go_module_dir

# The staging module of Kubernetes v1.34.4 (the Makefile's KUBERNETES_VERSION).
KUBELET_MODULE = "k8s.io/kubelet@v0.34.4"
API_DIR = "pkg/apis/pluginregistration/v1"
OURS = "csi/proto/pluginregistration.proto"


def kubelet_api_dir() -> Path:
    return go_module_dir(KUBELET_MODULE) / API_DIR


def compile_proto(include: Path, name: str, out: Path) -> descriptor_pb2.FileDescriptorProto:
    with importlib.resources.as_file(importlib.resources.files("grpc_tools") / "_proto") as wkt:
        argv = ["protoc", f"-I{include}", f"-I{wkt}", f"--descriptor_set_out={out}", name]
        assert protoc.main(argv) == 0, f"protoc failed on {include / name}"
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return next(f for f in files if f.name == name)


def wire(file: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    """What travels or names a call: package, fields by number, services' methods."""
    return {
        "package": file.package,
        "syntax": file.syntax,
        "messages": {
            m.name: {f.number: (f.name, f.type, f.label, f.type_name) for f in m.field}
            for m in file.message_type
        },
        "services": {
            s.name: {
                m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                for m in s.method
            }
            for s in file.service
        },
    }


@pytest.fixture(scope="module")
def kubelet_dir() -> Path:
    return kubelet_api_dir()


def test_our_proto_is_kubelets_on_the_wire(kubelet_dir: Path, tmp_path: Path) -> None:
    theirs = compile_proto(kubelet_dir, "api.proto", tmp_path / "theirs.pb")
    ours = compile_proto(REPO, OURS, tmp_path / "ours.pb")
    assert wire(theirs)["messages"].keys() >= {"PluginInfo", "RegistrationStatus"}
    assert wire(ours) == wire(theirs)


def test_the_method_names_are_the_ones_kubelet_dials(kubelet_dir: Path) -> None:
    from csi.proto import pluginregistration_pb2 as reg

    go_client = (kubelet_dir / "api_grpc.pb.go").read_text()
    dialed = set(re.findall(r'_FullMethodName\s*=\s*"([^"]+)"', go_client))
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    ours = {f"/{service.full_name}/{m.name}" for m in service.methods}
    expected = {
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    }
    assert dialed == ours == expected


def test_the_plugin_type_is_kubelets_name_for_a_csi_plugin(kubelet_dir: Path) -> None:
    from csi.registration import PLUGIN_TYPE

    constants = (kubelet_dir / "constants.go").read_text()
    found = re.search(r'\bCSIPlugin\s*=\s*"([^"]+)"', constants)
    assert found is not None, "no CSIPlugin constant in kubelet's constants.go"
    assert found[1] == PLUGIN_TYPE

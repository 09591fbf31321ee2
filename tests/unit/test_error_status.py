"""Status codes both ways, over every gRPC status code, through real servers.

(a) What a moorage gRPC server answers for each of the project's exceptions:
a server on a unix socket with the one error interceptor installed, its one
method raising what each case names.

(b) What the CSI controller answers for each status a storage node may end a
call with: a fake storage node on a unix socket answers ControllerGetVolume's
backend call with that status, the real ControllerService behind the same
interceptor answers the CO (the spec's error scheme: PERMISSION_DENIED and
UNAUTHENTICATED keep their meaning).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from backend.api import errors as api_errors
from backend.api.interceptor import MAX_DETAILS, ErrorInterceptor, Outcome
from backend.api.proto import backend_pb2 as bpb
from csi import errors as csi_errors
from csi.config import PluginConfig, StorageNodeConfig
from csi.controller import ControllerService
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.storagenodes import StorageNodes

Code = grpc.StatusCode
LOGGER = "moorage.test.errorstatus"

# ------------------------------------------------ (a) exceptions to statuses

# Every status code, and what of the project's raising answers it.  A call
# that returns answers OK; a method nobody wrote (NotImplementedError)
# UNIMPLEMENTED; any exception not the project's own INTERNAL.
RAISED: dict[grpc.StatusCode, list[type[BaseException] | None]] = {
    Code.OK: [None],  # nothing raised
    Code.CANCELLED: [],
    Code.UNKNOWN: [],
    Code.INVALID_ARGUMENT: [api_errors.InvalidArgument, csi_errors.InvalidArgument],
    Code.DEADLINE_EXCEEDED: [csi_errors.DeadlineExceeded],
    Code.NOT_FOUND: [api_errors.NotFound, csi_errors.NotFound],
    Code.ALREADY_EXISTS: [api_errors.AlreadyExists, csi_errors.AlreadyExists],
    Code.PERMISSION_DENIED: [csi_errors.PermissionDenied],
    Code.RESOURCE_EXHAUSTED: [api_errors.ResourceExhausted, csi_errors.ResourceExhausted],
    Code.FAILED_PRECONDITION: [api_errors.FailedPrecondition, csi_errors.FailedPrecondition],
    Code.ABORTED: [csi_errors.Aborted],
    Code.OUT_OF_RANGE: [csi_errors.OutOfRange],
    Code.UNIMPLEMENTED: [csi_errors.Unimplemented, NotImplementedError],
    Code.INTERNAL: [
        api_errors.StatusError,
        api_errors.BackendError,
        api_errors.CommandFailed,
        csi_errors.CsiError,
        csi_errors.Internal,
        RuntimeError,
    ],
    Code.UNAVAILABLE: [api_errors.Unavailable, csi_errors.Unavailable],
    Code.DATA_LOSS: [],
    Code.UNAUTHENTICATED: [csi_errors.Unauthenticated],
}


def _key(kind: type[BaseException] | None) -> str:
    return "ok" if kind is None else f"{kind.__module__}.{kind.__qualname__}"


def _instance(kind: type[BaseException], message: str) -> BaseException:
    if kind is api_errors.CommandFailed:
        return api_errors.CommandFailed(["mkfs.xfs", "/dev/x"], 1, message)
    return kind(message)


def _message(kind: type[BaseException] | None) -> str:
    return f"raised {kind.__qualname__}" if kind is not None else ""


def _expected_details(kind: type[BaseException] | None) -> str:
    if kind is None:
        return ""
    if kind is NotImplementedError:
        return "Raise is not implemented"
    if kind is api_errors.CommandFailed:
        return f"mkfs.xfs exited 1: {_message(kind)}"
    if kind is RuntimeError:
        return f"internal error: {_message(kind)}"
    return _message(kind)


def _all_subclasses(kind: type[BaseException]) -> set[type[BaseException]]:
    found = {kind}
    for sub in kind.__subclasses__():
        found |= _all_subclasses(sub)
    return found


@dataclass
class Served:
    address: str
    outcomes: list[Outcome]


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:
    # unix socket paths are short; pytest's tmp_path may not be
    with tempfile.TemporaryDirectory(prefix="errst-") as d:
        yield Path(d)


def _serve(path: Path, add: Callable[[grpc.Server], None], outcomes: list[Outcome]) -> grpc.Server:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[ErrorInterceptor(logging.getLogger(LOGGER), outcomes.append)],
    )
    add(server)
    assert server.add_insecure_port(f"unix:{path}") != 0
    server.start()
    return server


def _raiser(request: bpb.GetVolumeRequest, context: grpc.ServicerContext) -> bpb.Volume:
    what = request.volume_id
    if what == "long":
        raise api_errors.InvalidArgument("x" * (MAX_DETAILS * 3))
    for kinds in RAISED.values():
        for kind in kinds:
            if kind is not None and _key(kind) == what:
                raise _instance(kind, _message(kind))
    return bpb.Volume(id=what)


@pytest.fixture(scope="module")
def raising_server(socket_dir: Path) -> Iterator[Served]:
    outcomes: list[Outcome] = []
    handler = grpc.method_handlers_generic_handler(
        "moorage.test.Errors",
        {
            "Raise": grpc.unary_unary_rpc_method_handler(
                _raiser,
                request_deserializer=bpb.GetVolumeRequest.FromString,
                response_serializer=bpb.Volume.SerializeToString,
            )
        },
    )
    server = _serve(
        socket_dir / "raise.sock", lambda s: s.add_generic_rpc_handlers((handler,)), outcomes
    )
    yield Served(f"unix:{socket_dir / 'raise.sock'}", outcomes)
    server.stop(None)


def _call_raw(address: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/moorage.test.Errors/Raise", request_serializer=bytes, response_deserializer=bytes
        )
        try:
            call(data, timeout=30)
        except grpc.RpcError as e:
            err = cast(grpc.Call, e)
            return err.code(), err.details() or ""
        return Code.OK, ""


def _call(address: str, what: str) -> tuple[grpc.StatusCode, str]:
    return _call_raw(address, bpb.GetVolumeRequest(volume_id=what).SerializeToString())


def test_the_table_covers_every_code_and_every_project_error() -> None:
    assert set(RAISED) == set(grpc.StatusCode)
    listed = {kind for kinds in RAISED.values() for kind in kinds}
    assert _all_subclasses(api_errors.StatusError) <= listed
    # each of the project's errors answers the code it names
    for code, kinds in RAISED.items():
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, api_errors.StatusError):
                assert kind.code == code, kind


@pytest.mark.parametrize(
    ("code", "kind"),
    [(code, kind) for code, kinds in RAISED.items() for kind in kinds],
    ids=lambda v: v.name if isinstance(v, grpc.StatusCode) else _key(v),
)
def test_what_is_raised_answers_its_status(
    raising_server: Served,
    caplog: pytest.LogCaptureFixture,
    code: grpc.StatusCode,
    kind: type[BaseException] | None,
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _call(raising_server.address, _key(kind)) == (code, _expected_details(kind))
    records = [r for r in caplog.records if r.name == LOGGER]
    if kind is RuntimeError:
        # unexpected: logged once, with its traceback
        assert len(records) == 1 and records[0].exc_info is not None, records
        assert records[0].getMessage() == "Raise failed unexpectedly"
    elif code == Code.INTERNAL:
        # a known kind of internal error: one line, no traceback
        assert len(records) == 1 and records[0].exc_info is None, records
        assert records[0].getMessage() == f"Raise failed: {_expected_details(kind)}"
    else:
        assert records == []
    outcome = raising_server.outcomes[-1]
    assert (outcome.name, outcome.code, outcome.message) == ("Raise", code, _expected_details(kind))
    assert outcome.method == "/moorage.test.Errors/Raise"
    assert outcome.request == bpb.GetVolumeRequest(volume_id=_key(kind))


def test_undecodable_request_bytes_answer_invalid_argument_without_a_traceback(
    raising_server: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        code, details = _call_raw(raising_server.address, b"\x0a\x02\xff\xfe")  # not UTF-8
    assert code == Code.INVALID_ARGUMENT
    # protobuf's reason follows (its wording is protobuf's own)
    assert details.startswith("undecodable request (4 bytes): ") and "GetVolumeRequest" in details
    # the server's observer is told (its log line); nothing else is logged
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    outcome = raising_server.outcomes[-1]
    assert (outcome.request, outcome.code, outcome.message) == (None, code, details)


def test_a_long_message_is_cut(raising_server: Served) -> None:
    code, details = _call(raising_server.address, "long")
    assert code == Code.INVALID_ARGUMENT
    assert len(details) == MAX_DETAILS and details.endswith("...")


# ------------------------------------ (b) a storage node's statuses to CSI's

# What the CSI controller answers for a backend call that ended with each
# status (OK: the storage node answered).
BACKEND_TO_CSI: dict[grpc.StatusCode, grpc.StatusCode] = {
    Code.OK: Code.OK,
    Code.CANCELLED: Code.ABORTED,
    Code.UNKNOWN: Code.UNAVAILABLE,
    Code.INVALID_ARGUMENT: Code.INVALID_ARGUMENT,
    Code.DEADLINE_EXCEEDED: Code.DEADLINE_EXCEEDED,
    Code.NOT_FOUND: Code.NOT_FOUND,
    Code.ALREADY_EXISTS: Code.ALREADY_EXISTS,
    Code.PERMISSION_DENIED: Code.PERMISSION_DENIED,
    Code.RESOURCE_EXHAUSTED: Code.RESOURCE_EXHAUSTED,
    Code.FAILED_PRECONDITION: Code.FAILED_PRECONDITION,
    Code.ABORTED: Code.ABORTED,
    Code.OUT_OF_RANGE: Code.OUT_OF_RANGE,
    Code.UNIMPLEMENTED: Code.INTERNAL,
    Code.INTERNAL: Code.INTERNAL,
    Code.UNAVAILABLE: Code.UNAVAILABLE,
    Code.DATA_LOSS: Code.INTERNAL,
    Code.UNAUTHENTICATED: Code.UNAUTHENTICATED,
}


def _volume_id(code: grpc.StatusCode) -> str:
    """A backend volume id that tells the fake storage node what to answer."""
    value: int = code.value[0]
    return f"{value:032x}"


def _fake_get_volume(request: bpb.GetVolumeRequest, context: grpc.ServicerContext) -> bpb.Volume:
    code = next(c for c in grpc.StatusCode if _volume_id(c) == request.volume_id)
    if code != Code.OK:
        context.abort(code, f"answered {code.name}")
    return bpb.Volume(id=request.volume_id, type=bpb.NBD, size_bytes=1 << 20, state="ready")


@pytest.fixture(scope="module")
def csi_controller(socket_dir: Path) -> Iterator[str]:
    """The address of a CSI controller whose storage node ``sn-a`` is the fake."""
    backend = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    backend.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "moorage.backend.v1.Backend",
                {
                    "GetVolume": grpc.unary_unary_rpc_method_handler(
                        _fake_get_volume,
                        request_deserializer=bpb.GetVolumeRequest.FromString,
                        response_serializer=bpb.Volume.SerializeToString,
                    )
                },
            ),
        )
    )
    assert backend.add_insecure_port(f"unix:{socket_dir / 'sn.sock'}") != 0
    backend.start()
    config = PluginConfig(
        storage_nodes=(StorageNodeConfig("sn-a", f"unix:{socket_dir / 'sn.sock'}", timeout=30),)
    )
    service = ControllerService(StorageNodes(config))
    outcomes: list[Outcome] = []
    server = _serve(
        socket_dir / "csi.sock",
        lambda s: pb_grpc.add_ControllerServicer_to_server(service, s),  # type: ignore[no-untyped-call]
        outcomes,
    )
    yield f"unix:{socket_dir / 'csi.sock'}"
    server.stop(None)
    backend.stop(None)


def test_the_backend_table_covers_every_code() -> None:
    assert set(BACKEND_TO_CSI) == set(grpc.StatusCode)
    assert set(csi_errors.FROM_BACKEND) == set(grpc.StatusCode) - {Code.OK}


@pytest.mark.parametrize(
    ("backend", "csi"), list(BACKEND_TO_CSI.items()), ids=lambda c: cast(Any, c).name
)
def test_a_storage_node_status_answers_its_csi_status(
    csi_controller: str, backend: grpc.StatusCode, csi: grpc.StatusCode
) -> None:
    request = pb.ControllerGetVolumeRequest(volume_id=f"sn-a:{_volume_id(backend)}")
    with grpc.insecure_channel(csi_controller) as channel:
        stub = pb_grpc.ControllerStub(channel)  # type: ignore[no-untyped-call]
        try:
            answer = stub.ControllerGetVolume(request, timeout=60)
        except grpc.RpcError as e:
            err = cast(grpc.Call, e)
            assert err.code() == csi, (backend, err.code(), err.details())
            assert "sn-a" in (err.details() or "")
            if backend not in (Code.OK, Code.NOT_FOUND):  # NOT_FOUND: no such volume
                assert err.details() == f"storage node sn-a: answered {backend.name}"
            return
    assert csi == Code.OK
    assert answer.volume.volume_id == request.volume_id

"""One CSI call from inside the kernel lane's guest, for tests the host drives.

``python -m tests.kernel.csicall ENDPOINT SERVICE METHOD`` reads the request
as JSON (protobuf's JSON mapping) on stdin, calls ``SERVICE.METHOD`` on the
plugin at ``ENDPOINT`` (unix:///PATH) and prints the response as JSON; a gRPC
error exits 1 with ``CODE: details`` on stderr.  A request or service that
does not exist exits 2.
"""

from __future__ import annotations

import sys

import grpc
from google.protobuf import json_format

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc

TIMEOUT = 300.0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m tests.kernel.csicall ENDPOINT SERVICE METHOD", file=sys.stderr)
        return 2
    endpoint, service, method = argv
    request_type = getattr(pb, f"{method}Request", None)
    stub_type = getattr(pb_grpc, f"{service}Stub", None)
    if request_type is None or stub_type is None:
        print(f"no CSI call {service}.{method}", file=sys.stderr)
        return 2
    request = json_format.Parse(sys.stdin.read() or "{}", request_type())
    with grpc.insecure_channel(endpoint) as channel:
        call = getattr(stub_type(channel), method)
        try:
            response = call(request, timeout=TIMEOUT)
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(response))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The one error interceptor of moorage's gRPC servers (the storage node's API, the CSI plugin).

Every unary call passes through :class:`ErrorInterceptor`, which owns what a
call answers when it does not succeed:

- request bytes that do not parse as the method's message answer
  INVALID_ARGUMENT (grpc itself would answer INTERNAL and log a traceback per
  request);
- a :class:`~backend.api.errors.StatusError` answers its own code and message
  (an INTERNAL one is logged, without a traceback: it is a known kind);
- a method the servicer does not implement answers UNIMPLEMENTED;
- any other exception is logged once, with its traceback, and answers INTERNAL.

Status messages are cut to :data:`MAX_DETAILS` characters.  Each call's
outcome goes to the server's observer (its log line, its histogram): the
interceptor itself logs only what went wrong on the server's side.
Servicers raise; they never call ``context.abort`` themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from backend.api.errors import StatusError

# The most of a status message a caller gets: grpc carries it in the trailing
# metadata, and one over its limit turns the answer into RESOURCE_EXHAUSTED.
MAX_DETAILS = 1000


def cut(message: str) -> str:
    """``message`` cut to :data:`MAX_DETAILS` characters."""
    if len(message) <= MAX_DETAILS:
        return message
    return message[: MAX_DETAILS - 3] + "..."


@dataclass(frozen=True)
class Outcome:
    """How one call ended, as its observer is told."""

    method: str  # the full method name, /package.Service/Method
    request: Any  # the request message; None when its bytes did not parse
    code: grpc.StatusCode
    message: str  # the status message ("" on success)
    seconds: float

    @property
    def name(self) -> str:
        """The method's own name (``CreateVolume``)."""
        return self.method.rsplit("/", 1)[-1]


Observer = Callable[[Outcome], None]


class _Undecodable:
    """Stands for a request whose bytes are not the method's request message."""

    def __init__(self, size: int, error: Exception) -> None:
        self.size = size
        self.error = error


class ErrorInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Errors to statuses for every unary call, logged on ``log``; each outcome to
    ``observe`` (see the module docstring)."""

    def __init__(self, log: logging.Logger, observe: Observer | None = None) -> None:
        self.log = log
        self.observe = observe

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        parse = handler.request_deserializer
        method = handler_call_details.method
        name = method.rsplit("/", 1)[-1]

        def deserialize(data: bytes) -> Any:
            try:
                return data if parse is None else parse(data)
            except Exception as e:
                return _Undecodable(len(data), e)

        def answer(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()
            code = grpc.StatusCode.OK
            message = ""
            try:
                if not isinstance(request, _Undecodable):
                    return inner(request, context)
                code = grpc.StatusCode.INVALID_ARGUMENT
                message = f"undecodable request ({request.size} bytes): {request.error}"
            except StatusError as e:
                code, message = e.code, str(e)
                if code == grpc.StatusCode.INTERNAL:
                    self.log.error("%s failed: %s", name, message)
            except NotImplementedError:  # a generated servicer's method nobody wrote
                code, message = grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented"
            except Exception as e:
                self.log.exception("%s failed unexpectedly", name)
                code, message = grpc.StatusCode.INTERNAL, f"internal error: {e}"
            finally:
                message = cut(message)
                if self.observe is not None:
                    seen = None if isinstance(request, _Undecodable) else request
                    elapsed = time.monotonic() - started
                    self.observe(Outcome(method, seen, code, message, elapsed))
            context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(
            answer,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )

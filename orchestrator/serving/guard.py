"""The gRPC server's interceptor: auth for every call, and one clear status for bytes that do not
parse or an error no method turned into a status (gRPC itself would answer UNKNOWN, quoting the
Python exception)."""

from __future__ import annotations

import sqlite3
import sys

import grpc

from polyspec.orchestrator.serving.bounded_json import LARGE_REQUEST_BYTES, return_memory_soon
from polyspec.orchestrator.serving.jobs import BROKEN, DAMAGED, FULL, TROUBLE, trouble
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.request_loop import INTERNAL_REASON
from polyspec.orchestrator.serving.security import Tenants
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Polyspec"].full_name  # polyspec.v1.Polyspec
STORE_STATUS = {FULL: grpc.StatusCode.RESOURCE_EXHAUSTED, DAMAGED: grpc.StatusCode.DATA_LOSS, BROKEN: grpc.StatusCode.INTERNAL}


class _Undecodable:
    """What a method gets instead of its message when the bytes do not parse."""


class Guard(grpc.aio.ServerInterceptor):
    """Every call passes here first.

    - Auth: with tokens, every Polyspec call (and reflection, with `protect_reflection`)
      needs `authorization: Bearer <token>` of a known tenant; health stays open.
    - Bytes that are not the method's message: INVALID_ARGUMENT with one line (gRPC
      itself would answer UNKNOWN naming the Python exception).
    """

    def __init__(self, tenants: Tenants, metrics: Metrics, protect_reflection: bool = False) -> None:
        self.tenants = tenants
        self.metrics = metrics
        self.protect_reflection = protect_reflection

    async def intercept_service(self, continuation, details):
        ours = details.method.startswith(f"/{SERVICE_NAME}/")
        reflection = "ServerReflection/" in details.method
        handler = await continuation(details)
        if handler is None:
            return None
        if self.tenants.enabled and (ours or (reflection and self.protect_reflection)):
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            if self.tenants.tenant_of(given) is None:
                if ours:
                    self.metrics.request_finished("unauthenticated")
                return _deny(handler, Tenants.denial(given))
        return _tolerant(handler, details.method, self.metrics) if ours else handler


def _deny(handler, message: str):
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, like the method it stands in for

    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, response_serializer=serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, response_serializer=serializer)
    return grpc.unary_unary_rpc_method_handler(deny, response_serializer=serializer)


async def _unexpected(exc: Exception, method: str, context, metrics: Metrics) -> None:
    """An error no method turned into a status: one line in the log, and a status whose text
    holds nothing of the exception (gRPC itself would answer UNKNOWN quoting it, which may
    carry stored prompts or results). A job store that cannot be written (disk full) is
    RESOURCE_EXHAUSTED, a damaged one DATA_LOSS, anything else INTERNAL."""
    if isinstance(exc, grpc.aio.AbortError):  # context.abort: the status is already set
        raise exc
    print(f"polyspec serve: {method.rsplit('/', 1)[-1]} failed: {exc!r}"[:500].replace("\n", " "), file=sys.stderr, flush=True)
    if isinstance(exc, sqlite3.Error):
        kind = trouble(exc)
        metrics.request_finished("resource_exhausted" if kind == FULL else "internal")
        await context.abort(STORE_STATUS[kind], TROUBLE[kind] + ("; retry later" if kind == FULL else ""))
    metrics.request_finished("internal")
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_REASON)


def _tolerant(handler, method: str, metrics: Metrics):
    """The same handler, with a request that does not parse answered INVALID_ARGUMENT."""
    decode = handler.request_deserializer

    def safe_decode(data: bytes):
        try:
            return decode(data)
        except Exception:  # noqa: BLE001 - any parse failure is the client's bytes
            return _Undecodable()

    def after(request) -> None:
        """A large request's pages go back to the system once it is freed (bounded_json.return_memory_soon)."""
        if isinstance(request, _Undecodable) or request.ByteSize() > LARGE_REQUEST_BYTES:
            return_memory_soon()

    async def check(request, context) -> None:
        if isinstance(request, _Undecodable):
            metrics.request_finished("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid message of this method (malformed protobuf)")

    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary(request, context):
            try:
                await check(request, context)
                return await behavior(request, context)
            except Exception as exc:  # noqa: BLE001 - see _unexpected
                await _unexpected(exc, method, context, metrics)
            finally:
                after(request)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=safe_decode,
                                                   response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        behavior = handler.unary_stream

        async def stream(request, context):
            try:
                await check(request, context)
                async for message in behavior(request, context):
                    yield message
            except Exception as exc:  # noqa: BLE001 - see _unexpected
                await _unexpected(exc, method, context, metrics)
            finally:
                after(request)

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=safe_decode,
                                                    response_serializer=handler.response_serializer)
    return handler

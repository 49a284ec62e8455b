"""Requests that do not parse end with INVALID_ARGUMENT naming the field, not UNKNOWN.

gRPC deserializes a request before any handler runs, and protobuf refuses a message whose `string` field is not
valid UTF-8 (or whose wire format is corrupt); grpc.aio then ends the call with UNKNOWN ("Unexpected
DecodeError"), which tells a client neither that its request was at fault nor where. The interceptor here gives
each unary request a deserializer that, when protobuf refuses the bytes, returns a `Malformed` value naming the
first field at fault (found by walking the wire format against the message's descriptor); the handler then ends
the call with INVALID_ARGUMENT without running. The API (`tandem.v1`) is unchanged, and a request that parses
costs nothing more.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

# Nested messages are walked at most this deep (protobuf's own parser stops at 100).
_MAX_DEPTH = 100


@dataclass(frozen=True)
class Malformed:
    """What a request that did not parse is deserialized to: the field at fault and what is wrong with it."""

    field: str
    problem: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}"


class _Corrupt(Exception):
    pass


def find_malformed(descriptor: Descriptor, data: bytes) -> Malformed:
    """The first field of a `descriptor` message in `data` that protobuf cannot parse: a string field that is
    not valid UTF-8 (named by its path, e.g. `messages.messages[1].content`), else the wire format itself."""
    try:
        fault = _first_fault(descriptor, data, "", 0)
    except _Corrupt:
        fault = None
    return fault or Malformed("request", "is not a valid protobuf message (corrupt wire format)")


def _first_fault(descriptor: Descriptor, data: bytes, prefix: str, depth: int) -> Malformed | None:
    if depth > _MAX_DEPTH:
        raise _Corrupt
    num_seen: dict[int, int] = {}  # occurrences of each repeated field so far, for its index in the path
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is not None and field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
                path = prefix + field.name
                if _is_repeated(field):
                    path += f"[{num_seen.get(number, 0)}]"
                    num_seen[number] = num_seen.get(number, 0) + 1
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return Malformed(path, "is not valid UTF-8")
                elif (fault := _first_fault(field.message_type, value, path + ".", depth + 1)) is not None:
                    return fault
        else:  # groups (3, 4) are not used by proto3; 6 and 7 do not exist
            raise _Corrupt
    if pos > len(data):
        raise _Corrupt
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Corrupt
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; `label` before
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _lenient(parse: Callable[[bytes], Any], descriptor: Descriptor) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            return find_malformed(descriptor, data)

    return deserialize


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Ends a unary request that protobuf cannot parse with INVALID_ARGUMENT naming the field."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = (handler_call_details.method or "").lstrip("/").replace("/", ".")  # type: ignore[attr-defined]
        try:
            descriptor = descriptor_pool.Default().FindMethodByName(method).input_type
        except KeyError:
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a sync handler (none in tandem) is left as it is
        make_handler = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                        else grpc.unary_unary_rpc_method_handler)
        return make_handler(_refusing_malformed(behavior),
                            request_deserializer=_lenient(handler.request_deserializer, descriptor),
                            response_serializer=handler.response_serializer)


def _refusing_malformed(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`behavior`, of the same kind (coroutine or async generator: grpc.aio drives them differently), ending the
    call with INVALID_ARGUMENT when its request is `Malformed`."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
            # aclosing: the handler's clean-up runs when the call ends, however it ends (as `map_errors` does).
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        return await behavior(request, context)

    return call

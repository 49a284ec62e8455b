"""API keys at the gateway (off unless keys are given): gRPC metadata and HTTP headers alike.

A client presents a key as `authorization: Bearer <key>` or `x-api-key: <key>`. Keys are compared in
constant time and never logged; a rejection names neither the key given nor the keys known.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

log = logging.getLogger(__name__)

API_KEYS_ENV = "TANDEM_API_KEYS"
# Open without a key even when keys are set: probes and discovery (container health checks use them).
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def parse_api_keys(flag_values: Sequence[str] | None, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """Keys from `--api-key` (repeatable, each comma-separated) and `$TANDEM_API_KEYS`; empty: auth off."""
    environ: Mapping[str, str] = os.environ if env is None else env
    raw = [*(flag_values or []), environ.get(API_KEYS_ENV, "")]
    return frozenset(key.strip() for value in raw for key in value.split(",") if key.strip())


class ApiKeys:
    """The keys the gateway accepts; `check(headers)` → whether the presented key is one of them."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, headers: Iterable[tuple[str, Any]]) -> bool:
        """True if auth is off or a header carries an accepted key (header names case-insensitive)."""
        if not self._keys:
            return True
        for name, value in headers:
            presented = _presented_key(name.lower(), value if isinstance(value, str) else value.decode())
            if presented is not None and self._accepts(presented.encode()):
                return True
        return False

    def _accepts(self, presented: bytes) -> bool:
        # Compare against every key, so the time taken does not depend on which one matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched


def _presented_key(name: str, value: str) -> str | None:
    if name == "authorization":
        scheme, _, token = value.strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    if name == "x-api-key":
        return value.strip()
    return None


UNAUTHENTICATED_MESSAGE = "missing or invalid API key (send authorization: Bearer <key> or x-api-key: <key>)"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call of the gateway's API without an accepted key with UNAUTHENTICATED (health checks and
    reflection stay open)."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""  # type: ignore[attr-defined]
        if handler is None or not self._keys.enabled or method.startswith(_OPEN_SERVICES):
            return handler
        if self._keys.check(handler_call_details.invocation_metadata or ()):  # type: ignore[attr-defined]
            return handler
        log.info("rejected %s: no accepted API key", method)
        return _rejecting(handler)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""
    streams_response = handler.response_streaming

    async def reject(context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    if streams_response:
        async def reject_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await reject(context)
            yield  # pragma: no cover  (abort raises)

        behavior: Callable[..., Any] = reject_stream
    else:
        async def reject_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await reject(context)

        behavior = reject_unary
    factory = {(False, False): grpc.unary_unary_rpc_method_handler,
               (False, True): grpc.unary_stream_rpc_method_handler,
               (True, False): grpc.stream_unary_rpc_method_handler,
               (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming, streams_response)]
    assert inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
    return factory(behavior, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)

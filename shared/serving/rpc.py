"""gRPC plumbing shared by the services: server setup, the one error ↔ status mapping (typed errors cross a
hop as themselves), the codes after which another worker may succeed, and a channel pool.

The engine core never imports grpc; the services do, through this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.config import ConfigError
from tandem.common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KVTransportError,
    LayoutMismatchError,
    OverloadedError,
    TandemError,
    UnavailableError,
    error_type,
)
from tandem.serving.auth import TokenChannel

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive pings find a dead peer on an idle stream (a decode worker waiting on a long prefill, say) so
# that the stream ends and both sides free what they hold. The server must accept pings at least as often
# as clients send them, or it answers with GOAWAY ("too_many_pings").
_KEEPALIVE_TIME_MS = 20_000
_KEEPALIVE_TIMEOUT_MS = 10_000
# A channel whose peer is not up yet retries with exponential backoff, up to gRPC's 120 s by default, and a call
# meanwhile fails at once: a peer that came up after ~20 s of refusals was reachable only 5.6-8.1 s later (loopback,
# 2026-12-07), which a prefill worker started after its decode worker (`--share-weights`) turned into a 2 s first
# request and, with `--kv-transport cuda-ipc`, a failed one. Peers are services of one deployment: try every second.
_MAX_RECONNECT_BACKOFF_MS = 1_000
_MIN_PING_INTERVAL_MS = 10_000
# gRPC core queues each new call until the server's loop asks for it, and refuses calls past a backlog (with
# random early drop from the soft limit, all past the hard one; defaults 1,000 and 3,000): the caller gets CANCELLED
# before any handler saw the call, so no limit of ours could answer it. grpc.aio takes calls one at a time from
# its event loop, so a burst (2,048 streams at once through one gateway connection on the 2-core VM) left ~230
# CANCELLED. The backlog may hold this many calls per stream a connection may open; the services' own bounds
# (the gateway's concurrency slots, decode's queue) then answer what they cannot take with RESOURCE_EXHAUSTED.
_PENDING_CALLS_PER_STREAM = 8
_MIN_PENDING_CALLS = 1000

# The one table from tandem errors to gRPC status codes; the first matching class wins.
_STATUS_OF_ERROR: tuple[tuple[type[TandemError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LayoutMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (KVTransportError, grpc.StatusCode.FAILED_PRECONDITION),
)

# Codes that mean the peer failed, not the request: another worker (or a local fallback) may succeed. A
# deadline is the request's own, and a refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, ...) would repeat.
PEER_FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})
# Trailing metadata naming the TandemError class a call ended with.
_ERROR_TYPE_KEY = "tandem-error"

AddServicers = Callable[[grpc.aio.Server], Iterable[str]]
_Behavior = TypeVar("_Behavior", bound=Callable[..., Any])


def status_of(error: TandemError) -> grpc.StatusCode:
    """The gRPC status code a tandem error is reported with (INTERNAL for an unmapped subclass)."""
    for cls, code in _STATUS_OF_ERROR:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def is_peer_failure(error: grpc.aio.AioRpcError) -> bool:
    return error.code() in PEER_FAILURE_CODES


def remote_error(error: grpc.aio.AioRpcError) -> TandemError | None:
    """The typed error a tandem server ended the call with (its class travels in trailing metadata), or None
    for any other failure (a dead peer, a bug, a non-tandem server)."""
    metadata = error.trailing_metadata() or ()
    name = next((value for key, value in metadata if key == _ERROR_TYPE_KEY), None)
    return typed_error(name if isinstance(name, str) else "", error.details() or "")


def typed_error(type_name: str, details: str) -> TandemError | None:
    """Rebuild a TandemError from its class name and message (as `remote_error` and session updates carry
    them); None when the name is not one."""
    cls = error_type(type_name) if type_name else None
    if cls is None:
        return None
    if cls is InvalidRequestError:
        field, _, message = details.partition(": ")
        return InvalidRequestError(field, message)
    return cls(details)


async def _abort(context: grpc.aio.ServicerContext, error: TandemError) -> None:
    code = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unmapped %s: %s", type(error).__name__, error)
    # str(InvalidRequestError) is "field: message", so the client learns which field to fix.
    await context.abort(code, str(error), trailing_metadata=((_ERROR_TYPE_KEY, type(error).__name__),))


def map_errors(behavior: _Behavior) -> _Behavior:
    """Wraps an aio handler so that a `TandemError` it raises ends the call with the mapped status.

    Works for coroutine handlers (unary responses, or streaming through `context.write`) and for
    async-generator handlers (streaming by `yield`); an error raised mid-stream ends the stream after the
    messages already sent. Other exceptions pass through untouched (gRPC reports them as UNKNOWN and logs
    them): they are bugs, not requests to reject. `ErrorMappingInterceptor` applies this to every handler.
    """
    if inspect.isasyncgenfunction(behavior):

        @functools.wraps(behavior)
        async def stream_wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                # aclosing: whenever this wrapper is closed (grpc.aio leaves that to the loop's
                # async-generator finalizer if the call is cancelled while it writes a message), the
                # handler's clean-up (freeing KV blocks, say) runs then, not when it is collected too.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except TandemError as error:
                await _abort(context, error)

        return stream_wrapper  # type: ignore[return-value]

    if inspect.iscoroutinefunction(behavior):

        @functools.wraps(behavior)
        async def unary_wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except TandemError as error:
                await _abort(context, error)

        return unary_wrapper  # type: ignore[return-value]

    # A synchronous handler runs in gRPC's executor, outside the event loop; tandem has none.
    raise TypeError(f"map_errors needs an async handler, got {behavior!r}")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Applies `map_errors` to every handler of the server, unary and streaming alike."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return handler
        # Exactly one of the four behaviors is set. The wrapper keeps its kind (coroutine or async
        # generator), which is how grpc.aio decides how to drive it.
        for name, make_handler in _HANDLER_FACTORIES.items():
            behavior = getattr(handler, name)
            if behavior is None:
                continue
            if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
                return handler  # a sync handler (none in tandem) is left as it is
            return make_handler(
                map_errors(behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


_HANDLER_FACTORIES: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def server_options(max_message_bytes: int, max_concurrent_streams: int) -> list[tuple[str, int]]:
    """The channel arguments of every tandem gRPC server (`start_server`)."""
    pending = max(_MIN_PENDING_CALLS, _PENDING_CALLS_PER_STREAM * max_concurrent_streams)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _MIN_PING_INTERVAL_MS),
    ]


async def start_server(
    bind: str,
    add_servicers: AddServicers,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_streams: int = 256,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: TlsConfig | None = None,
    serving: bool = True,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts a grpc.aio server (plaintext, or TLS when `tls` is given) with health checking and reflection.

    `add_servicers(server)` registers the service implementations and returns their full names (e.g.
    "tandem.v1.Decode"); each is marked SERVING in grpc.health.v1 (NOT_SERVING with `serving` False, for a service
    that warms up after it listens: `set_serving`), as is the whole server (""), and
    listed by server reflection. `bind` is "host:port"; port 0 picks a free port. Tandem errors raised by
    handlers are mapped to status codes by `ErrorMappingInterceptor`, innermost, so `interceptors` (e.g.
    tracing) see the final status. Returns the started server, the bound port and the health servicer
    (to flip statuses, or `enter_graceful_shutdown()` before a drain).
    """
    server = grpc.aio.server(
        interceptors=[*interceptors, ErrorMappingInterceptor()],
        options=server_options(max_message_bytes, max_concurrent_streams),
    )
    service_names = list(add_servicers(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, service_names, serving)
    reflected = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(reflected, server)
    port = server.add_secure_port(bind, tls.server_credentials()) if tls else server.add_insecure_port(bind)
    if port == 0:  # older grpcio reports a failed bind this way instead of raising
        raise OSError(f"cannot bind gRPC server to {bind!r}")
    await server.start()
    log.info("gRPC server on %s (port %d) serving %s", bind, port, ", ".join(service_names) or "nothing")
    return server, port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service_names: Sequence[str], serving: bool) -> None:
    """Marks the whole server ("") and each of `service_names` SERVING (or NOT_SERVING) in grpc.health.v1."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


async def stop_server(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_s: float
) -> None:
    """Drains and stops a server: reports NOT_SERVING at once, then lets calls in flight finish for up to
    `grace_s` seconds before cancelling them."""
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """tandem's channel options: message limits, keepalive pings, the reconnect backoff's cap."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # Keep pinging an idle connection: without this the client stops after two pings with no data.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
    ]


def make_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TlsConfig | None = None, internal_token: str | None = None,
                 extra_options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Channel:
    """A channel to "host:port" with tandem's message-size limits and keepalive pings (`channel_options`, then
    `extra_options`); TLS (presenting this service's certificate, for mutual TLS) when `tls` is given, plaintext
    otherwise; every call carries `internal_token` (the stack's, `tandem.serving.auth`) when given."""
    options = [*channel_options(max_message_bytes), *extra_options]
    if tls is not None:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    else:
        channel = grpc.aio.insecure_channel(address, options=options)
    return channel if internal_token is None else TokenChannel(channel, internal_token)


class ChannelPool:
    """One channel per peer address, made on first use and kept while it is used (a channel reconnects by itself);
    its calls carry `internal_token` when given. A channel not asked for in `idle_close_s` that is failing to connect
    (TRANSIENT_FAILURE: most likely a worker that went away) is closed at the next `get`, so a long-running service
    does not keep dialling, once a second (`channel_options`' backoff cap), every address it ever used; asking for
    that address again makes a fresh channel."""

    idle_close_s = 60.0

    def __init__(self, tls: TlsConfig | None = None, internal_token: str | None = None) -> None:
        self.tls = tls
        self.internal_token = internal_token
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._last_used: dict[str, float] = {}
        self._next_sweep = 0.0
        self._closing: set[asyncio.Task[None]] = set()

    def _make(self, address: str) -> grpc.aio.Channel:
        return make_channel(address, tls=self.tls, internal_token=self.internal_token)

    def get(self, address: str) -> grpc.aio.Channel:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._close_failing(now)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._make(address)
        self._last_used[address] = now
        return channel

    def _close_failing(self, now: float) -> None:
        self._next_sweep = now + self.idle_close_s
        for address, channel in list(self._channels.items()):
            idle_s = now - self._last_used[address]
            if idle_s >= self.idle_close_s and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                del self._channels[address], self._last_used[address]
                log.info("closing the channel to %s: unused for %.0f s and failing to connect", address, idle_s)
                task = asyncio.get_running_loop().create_task(channel.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._last_used.clear()
        for channel in channels:
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


@dataclass(frozen=True)
class TlsConfig:
    """TLS on a service's gRPC hops (off unless configured): its certificate and key, and the CA that signs
    its peers. With a CA, servers require client certificates (mutual TLS between services) unless
    `client_auth` is off (the gateway's public port), and clients verify servers against it."""

    cert_file: str
    key_file: str
    ca_file: str | None = None
    client_auth: bool = True

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"tls {name}: {path} is not a readable file")

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())],
            root_certificates=ca, require_client_auth=bool(ca) and self.client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=Path(self.key_file).read_bytes(),
                                            certificate_chain=Path(self.cert_file).read_bytes())

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None, client_auth: bool = True
                   ) -> TlsConfig | None:
        if cert is None and key is None and ca is None:
            return None
        if cert is None or key is None:
            raise ConfigError("tls: give both --tls-cert and --tls-key (and --tls-ca to verify peers)")
        return cls(cert, key, ca, client_auth)

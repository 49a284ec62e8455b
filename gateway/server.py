"""`tandem gateway`: the public entry point."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.gateway.auth import ApiKeyInterceptor, ApiKeys
from tandem.gateway.http_api import HttpServer, create_app, start_http_server
from tandem.gateway.limits import GatewayLimits
from tandem.gateway.request_decoding import MalformedRequestInterceptor
from tandem.gateway.router import GatewayModel, Router
from tandem.gateway.servicer import GenerationServicer
from tandem.models import load_model_config, load_tokenizer
from tandem.models.detokenizer import warm_detokenizer
from tandem.serving.registry import CacheSummary, RedisRegistry, Registry, StaticRegistry, WorkerRecord
from tandem.serving.rpc import ChannelPool, TlsConfig
from tandem.serving.service import ServiceOptions, run_service
from tandem.serving.wire import layout_from_proto
from tandem.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

class InfoProbe:
    """Asks a worker's health and `Info` for its layout, load and prefix cache summary (the static registry's
    refresh); a worker that is draining (health NOT_SERVING) counts as down, so no new request goes there. The
    record's `updated_at` is when the probe was sent (this gateway's clock): what it says was true at least then."""

    def __init__(self, tls: TlsConfig | None = None, internal_token: str | None = None) -> None:
        self.channels = ChannelPool(tls, internal_token)
        self._unauthenticated: set[str] = set()  # workers that refused this gateway's internal token, logged once

    async def __call__(self, role: str, address: str) -> WorkerRecord | None:
        channel = self.channels.get(address)
        stub = worker_pb2_grpc.PrefillStub(channel) if role == "prefill" else worker_pb2_grpc.DecodeStub(channel)
        sent_at = time.time()
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                     timeout=1.0)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return None
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=1.0)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # Late, maybe only because this gateway is busy: the registry leaves the worker out after several.
                raise asyncio.TimeoutError from None
            if error.code() == grpc.StatusCode.UNAUTHENTICATED and address not in self._unauthenticated:
                self._unauthenticated.add(address)
                log.error("%s worker %s refuses this gateway: %s", role, address, error.details())
            return None
        try:
            cache = CacheSummary.from_proto(info.prefix_cache)
        except ValueError as error:
            log.warning("%s worker %s: ignoring its prefix cache summary: %s", role, address, error)
            cache = None
        return WorkerRecord(role=role, address=address, model=info.model,
                            fingerprint=layout_from_proto(info.layout).fingerprint(),
                            num_free_blocks=info.num_free_blocks, num_total_blocks=info.num_total_blocks,
                            queue_depth=info.queue_depth, worker_id=f"{role}@{address}", updated_at=sent_at,
                            max_model_len=info.max_model_len, vocab_size=info.vocab_size, cache=cache)


# A gateway with no --max-model-len caps the context as the workers' engines do by default; the workers' own
# limits (from Info or the registry) apply on top (`Router.max_model_len`).
DEFAULT_MAX_MODEL_LEN = 8192
# Streams one client connection may open beyond the concurrency limit: health checks, `Tokenize` and
# `ListModels` calls, and `Generate` calls that will be refused with RESOURCE_EXHAUSTED (not reset).
STREAMS_HEADROOM = 256


def load_gateway_model(name: str, max_model_len: int | None = None) -> GatewayModel:
    config = load_model_config(name)
    limit = max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    tokenizer = load_tokenizer(config)
    warm_detokenizer(tokenizer)  # its byte table takes a fraction of a second: not on the first request
    return GatewayModel(name=name, config=config, max_model_len=limit, tokenizer=tokenizer)


def gateway_service_options(service: ServiceOptions, max_concurrent_requests: int,
                            limits: GatewayLimits) -> ServiceOptions:
    """The gateway's gRPC port: a pooled client may send all its requests over one connection, so one connection
    may carry as many streams as the gateway takes requests (and some); messages are bounded as HTTP bodies are."""
    streams = max(service.max_concurrent_streams, max_concurrent_requests + STREAMS_HEADROOM)
    return replace(service, max_concurrent_streams=streams, max_message_bytes=limits.max_request_bytes)


async def serve(service: ServiceOptions, model: str, prefill: Sequence[str], decode: Sequence[str],
                max_model_len: int | None = None, *, max_concurrent_requests: int = 1024,
                api_keys: frozenset[str] = frozenset(), limits: GatewayLimits | None = None,
                on_started: Callable[[str, int], None] | None = None, stop: asyncio.Event | None = None,
                reuse_port: bool = False) -> None:
    """Serve the gateway until SIGTERM (or `stop`, for a gateway run inside a test), then drain: gRPC and HTTP
    refuse new requests (UNAVAILABLE, 503; `/health` 503) while those in flight finish, for up to `drain_s`.
    With `reuse_port`, the HTTP port is bound with SO_REUSEPORT, as gRPC's always is: one of the processes of
    `tandem gateway --workers N` (`tandem.gateway.workers`)."""
    limits = limits or GatewayLimits()
    registry: Registry
    probe: InfoProbe | None = None
    if service.redis_url:
        registry = RedisRegistry(service.redis_url)
    else:
        probe = InfoProbe(service.tls, service.internal_token)
        registry = StaticRegistry(prefill, decode, probe)
    await registry.start()
    router = Router(load_gateway_model(model, max_model_len), registry,
                    max_concurrent_requests=max_concurrent_requests, tls=service.tls, limits=limits,
                    internal_token=service.internal_token)
    keys = ApiKeys(api_keys)

    http: HttpServer | None = None

    def add(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
        return ["tandem.v1.Generation"]

    async def start_http(host: str, port: int) -> int:
        # The OpenAI-compatible API (and /metrics) in this event loop, sharing the router with gRPC.
        nonlocal http
        http = await start_http_server(create_app(router, keys), host, port, grace_s=service.drain_s,
                                       reuse_port=reuse_port)
        return http.port

    drain_deadline = 0.0

    def on_drain() -> None:
        nonlocal drain_deadline
        drain_deadline = time.monotonic() + service.drain_s
        router.begin_drain()

    async def cleanup() -> None:
        if http is not None:
            # gRPC's calls have finished (or run out of time); HTTP keeps answering 503 to new requests while
            # its own finish, then stops (before the router's channels close under its streams).
            idle = await router.admission.wait_idle(max(0.0, drain_deadline - time.monotonic()))
            await http.stop(force=not idle)
        await router.close()
        await registry.stop()
        if probe is not None:
            await probe.channels.close()

    # Unparseable requests first (INVALID_ARGUMENT naming the field), inside the API-key check.
    interceptors: list[grpc.aio.ServerInterceptor] = [ApiKeyInterceptor(keys)] if keys.enabled else []
    interceptors.append(MalformedRequestInterceptor())
    await run_service(gateway_service_options(service, max_concurrent_requests, limits), add, cleanup=cleanup,
                      start_http=start_http, interceptors=interceptors, on_drain=on_drain, on_started=on_started,
                      stop=stop)

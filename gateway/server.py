"""`tandem gateway`: the public entry point."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.gateway.auth import ApiKeyInterceptor, ApiKeys
from tandem.gateway.http_api import HttpServer, create_app, start_http_server
from tandem.gateway.router import GatewayModel, Router
from tandem.gateway.servicer import GenerationServicer
from tandem.models import load_model_config, load_tokenizer
from tandem.serving.registry import RedisRegistry, Registry, StaticRegistry, WorkerRecord
from tandem.serving.rpc import ChannelPool, TlsConfig
from tandem.serving.service import ServiceOptions, run_service
from tandem.serving.wire import layout_from_proto
from tandem.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc


class InfoProbe:
    """Asks a worker's health and `Info` for its layout and load (the static registry's refresh); a worker
    that is draining (health NOT_SERVING) counts as down, so no new request goes there."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.channels = ChannelPool(tls)

    async def __call__(self, role: str, address: str) -> WorkerRecord | None:
        channel = self.channels.get(address)
        stub = worker_pb2_grpc.PrefillStub(channel) if role == "prefill" else worker_pb2_grpc.DecodeStub(channel)
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                     timeout=1.0)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return None
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return None
        return WorkerRecord(role=role, address=address, model=info.model,
                            fingerprint=layout_from_proto(info.layout).fingerprint(),
                            num_free_blocks=info.num_free_blocks, num_total_blocks=info.num_total_blocks,
                            queue_depth=info.queue_depth, worker_id=f"{role}@{address}", updated_at=time.time(),
                            max_model_len=info.max_model_len, vocab_size=info.vocab_size)


# A gateway with no --max-model-len caps the context as the workers' engines do by default; the workers' own
# limits (from Info or the registry) apply on top (`Router.max_model_len`).
DEFAULT_MAX_MODEL_LEN = 8192


def load_gateway_model(name: str, max_model_len: int | None = None) -> GatewayModel:
    config = load_model_config(name)
    limit = max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    return GatewayModel(name=name, config=config, max_model_len=limit, tokenizer=load_tokenizer(config))


async def serve(service: ServiceOptions, model: str, prefill: Sequence[str], decode: Sequence[str],
                max_model_len: int | None = None, *, max_concurrent_requests: int = 1024,
                api_keys: frozenset[str] = frozenset()) -> None:
    registry: Registry
    probe: InfoProbe | None = None
    if service.redis_url:
        registry = RedisRegistry(service.redis_url)
    else:
        probe = InfoProbe(service.tls)
        registry = StaticRegistry(prefill, decode, probe)
    await registry.start()
    router = Router(load_gateway_model(model, max_model_len), registry,
                    max_concurrent_requests=max_concurrent_requests, tls=service.tls)
    keys = ApiKeys(api_keys)

    http: HttpServer | None = None

    def add(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
        return ["tandem.v1.Generation"]

    async def start_http(host: str, port: int) -> int:
        # The OpenAI-compatible API (and /metrics) in this event loop, sharing the router with gRPC.
        nonlocal http
        http = await start_http_server(create_app(router, keys), host, port, grace_s=service.drain_s)
        return http.port

    async def cleanup() -> None:
        if http is not None:  # before the router's channels close under its streams
            await http.stop()
        await router.close()
        await registry.stop()
        if probe is not None:
            await probe.channels.close()

    await run_service(service, add, cleanup=cleanup, start_http=start_http,
                      interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else [])

"""Conditional disaggregation (`GatewayLimits.local_prefill_max_tokens`) with real workers on loopback (dummy:tiny,
blocks of 16): a prompt with few tokens outside its decode worker's prefix cache is prefilled by the decode worker,
labelled `short_prompt`, though a prefill worker is up; a longer one goes to the prefill worker; a long prompt whose
prefix the decode worker holds counts only its uncached tokens."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.common.config import ConfigError
from tandem.gateway.limits import GatewayLimits
from tandem.gateway.router import Router
from tandem.gateway.server import InfoProbe, load_gateway_model
from tandem.gateway.servicer import GenerationServicer
from tandem.serving import metrics
from tandem.serving.registry import StaticRegistry
from tandem.serving.rpc import make_channel, start_server
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.services.test_kv_routing import BLOCK, lists, wait_for
from tests.services.test_reliability import MODEL, Worker, start_worker

LOCAL_MAX = 24  # tokens: one block and a half


@dataclass
class Cluster:
    prefill: Worker
    decode: Worker
    registry: StaticRegistry
    spans: InMemorySpanExporter
    gateway: generation_pb2_grpc.GenerationStub

    def last_route(self) -> dict[str, Any]:
        return dict([s for s in self.spans.get_finished_spans() if s.name == "route"][-1].attributes or {})


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    prefill, decode = await start_worker("prefill"), await start_worker("decode")
    probe = InfoProbe()
    registry = StaticRegistry([prefill.address], [decode.address], probe)
    await registry.start()
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    router = Router(load_gateway_model(MODEL, 256), registry, tracer=provider.get_tracer("test"),
                    limits=GatewayLimits(local_prefill_max_tokens=LOCAL_MAX))

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
        return ["tandem.v1.Generation"]

    server, port, _ = await start_server("127.0.0.1:0", register)
    stub = generation_pb2_grpc.GenerationStub(make_channel(f"127.0.0.1:{port}"))
    yield Cluster(prefill, decode, registry, spans, stub)
    await server.stop(0)
    await router.close()
    await registry.stop()
    await probe.channels.close()
    for worker in (prefill, decode):
        await worker.server.stop(0)
        worker.engine.close()


def local_tokens(reason: str) -> float:
    return metrics.LOCAL_PREFILL_TOKENS.labels(reason=reason)._value.get()


def prefilled_remotely(cluster: Cluster) -> int:
    """Prompt tokens the prefill worker's engine has computed so far."""
    return cluster.prefill.engine.engine.block_pool.prefix_cache_stats.num_query_tokens


async def generate(cluster: Cluster, prompt: list[int]) -> list[int]:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    async for response in cluster.gateway.Generate(request, timeout=60):
        tokens += response.token_ids
    return tokens


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 4000) for _ in range(length)]


async def test_short_prompts_stay_on_decode_and_long_ones_go_to_the_prefill_worker(cluster: Cluster) -> None:
    short_before, remote_before = local_tokens("short_prompt"), prefilled_remotely(cluster)
    assert len(await generate(cluster, prompt_of(1, LOCAL_MAX))) == 4
    route = cluster.last_route()
    assert route["tandem.route.prefill"] == "" and "local_prefill_max_tokens" in route["tandem.route.reason"], route
    assert local_tokens("short_prompt") == short_before + LOCAL_MAX
    assert prefilled_remotely(cluster) == remote_before  # the prefill worker never saw it

    long_prompt = prompt_of(2, 3 * BLOCK)
    assert len(await generate(cluster, long_prompt)) == 4
    route = cluster.last_route()
    assert route["tandem.route.prefill"] == cluster.prefill.address, route
    assert local_tokens("short_prompt") == short_before + LOCAL_MAX
    assert prefilled_remotely(cluster) > remote_before

    # Once the decode worker's summary lists the long prompt's blocks, the same prompt and 8 more tokens leave 8
    # (within the limit) to compute: decode prefills them itself, the rest from its own cache.
    await wait_for(lambda: lists(cluster.registry.workers("decode")[0], long_prompt), 2.0,
                   "the decode worker's summary to list the prompt")
    extended = long_prompt + prompt_of(3, 8)
    assert len(extended) > LOCAL_MAX
    remote_before = prefilled_remotely(cluster)
    assert len(await generate(cluster, extended)) == 4
    route = cluster.last_route()
    matched = route["tandem.route.decode_matched_blocks"]
    assert route["tandem.route.prefill"] == "" and matched == 3, route
    assert f"{len(extended) - matched * BLOCK} uncached prompt tokens" in route["tandem.route.reason"], route
    assert prefilled_remotely(cluster) == remote_before


def test_a_negative_limit_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="local_prefill_max_tokens"):
        GatewayLimits(local_prefill_max_tokens=-1)

"""KV-aware routing with real workers on loopback (dummy:tiny, blocks of 16): the gateway sends a request to the decode
worker that holds its prefix even when another is less loaded, reports the cached tokens in the gRPC usage, sends a
prompt nobody holds to the least loaded worker, and sees what workers cache through `Info` and through Redis."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.common.prefix_cache import block_hashes
from tandem.common.sampling_params import SamplingParams
from tandem.gateway.router import Router
from tandem.gateway.server import InfoProbe, load_gateway_model
from tandem.gateway.servicer import GenerationServicer
from tandem.serving.registry import RedisRegistry, StaticRegistry, WorkerRecord, prefix_of
from tandem.serving.rpc import make_channel, start_server
from tandem.serving.wire import sampling_to_worker
from tandem.serving.worker import worker_record
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services.test_reliability import MODEL, Worker, start_worker

if TYPE_CHECKING:
    from tests.redis_server import RedisServer

pytest_plugins = ["tests.redis_server"]

BLOCK = 16
PREFIX = [random.Random(1).randrange(100, 4000) for _ in range(10 * BLOCK)]  # 10 full blocks


@dataclass
class Cluster:
    prefill: Worker
    decodes: list[Worker]
    registry: StaticRegistry
    router: Router
    spans: InMemorySpanExporter
    gateway: generation_pb2_grpc.GenerationStub

    def record(self, worker: Worker) -> WorkerRecord:
        return next(w for w in self.registry.workers("decode") if w.address == worker.address)

    def last_route(self) -> dict[str, Any]:
        return dict([s for s in self.spans.get_finished_spans() if s.name == "route"][-1].attributes or {})


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    prefill = await start_worker("prefill")
    decodes = [await start_worker("decode") for _ in range(2)]
    probe = InfoProbe()
    registry = StaticRegistry([prefill.address], [d.address for d in decodes], probe)  # probed every 0.25 s
    await registry.start()
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    router = Router(load_gateway_model(MODEL, 256), registry, tracer=provider.get_tracer("test"))

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
        return ["tandem.v1.Generation"]

    server, port, _ = await start_server("127.0.0.1:0", register)
    yield Cluster(prefill, decodes, registry, router, spans,
                  generation_pb2_grpc.GenerationStub(make_channel(f"127.0.0.1:{port}")))
    await server.stop(0)
    await router.close()
    await registry.stop()
    await probe.channels.close()
    for worker in (prefill, *decodes):
        await worker.server.stop(0)
        worker.engine.close()


async def generate(cluster: Cluster, prompt: list[int]) -> generation_pb2.GenerateResponse:
    """The last message of a greedy 4-token generation through the gateway's gRPC API."""
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    responses = [r async for r in cluster.gateway.Generate(request, timeout=60)]
    return responses[-1]


async def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def headroom(candidate: str) -> float:
    """A traced candidate's headroom ("ADDRESS matched=M headroom=H cost=C")."""
    return float(candidate.split("headroom=")[1].split()[0])


def lists(record: WorkerRecord, prompt: list[int]) -> bool:
    """Whether the record's summary lists every full block of `prompt`."""
    hashes = block_hashes(prompt, BLOCK, record.fingerprint)
    return record.cache is not None and {prefix_of(h) for h in hashes} <= record.cache.prefixes


async def test_a_shared_prefix_follows_its_cache_and_a_new_prompt_the_load(cluster: Cluster) -> None:
    first = await generate(cluster, PREFIX + [5] * 8)
    assert first.usage.cached_tokens == 0  # cold
    holder = next(d for d in cluster.decodes if d.engine.engine.block_pool.num_cached_blocks)
    other = next(d for d in cluster.decodes if d is not holder)
    # The gateway's view of the holder lists the prefix soon (a probe every 0.25 s; generous bound for a loaded CPU).
    await wait_for(lambda: lists(cluster.record(holder), PREFIX), 1.5, "the holder's summary to list the prefix")

    # Load the holder with a long generation of its own, sent straight to it (not through this gateway).
    stub = worker_pb2_grpc.DecodeStub(make_channel(holder.address))
    busy = worker_pb2.DecodeRequest(request_id="busy", prompt_token_ids=list(range(200, 220)),
                                    sampling=sampling_to_worker(SamplingParams(max_tokens=200, temperature=0.0,
                                                                               ignore_eos=True, seed=0)))
    call = stub.Generate(busy, timeout=120)
    try:
        await call.read()  # its first token: it holds blocks now
        await wait_for(lambda: cluster.record(holder).num_free_blocks < cluster.record(other).num_free_blocks, 2.0,
                       "the gateway to see the holder busier")

        second = await generate(cluster, PREFIX + [9] * 8)
        route = cluster.last_route()
        assert route["tandem.route.decode"] == holder.address, route
        assert route["tandem.route.cache_aware"] and route["tandem.route.decode_matched_blocks"] == 10
        assert "cache-aware: 10/10" in route["tandem.route.reason"]
        candidates = route["tandem.route.decode_candidates"]
        assert candidates[0].startswith(f"{holder.address} matched=10")
        assert candidates[1].startswith(f"{other.address} matched=0")
        assert headroom(candidates[0]) < headroom(candidates[1])  # the other worker was the less loaded
        assert second.usage.cached_tokens == 10 * BLOCK and second.usage.prompt_tokens == len(PREFIX) + 8

        fresh = [random.Random(2).randrange(100, 4000) for _ in range(len(PREFIX) + 8)]
        third = await generate(cluster, fresh)
        route = cluster.last_route()
        assert route["tandem.route.decode"] == other.address, route
        assert not route["tandem.route.cache_aware"] and "least loaded" in route["tandem.route.reason"]
        assert third.usage.cached_tokens == 0
    finally:
        call.cancel()


async def test_workers_publish_their_cache_through_redis(cluster: Cluster, redis_server: RedisServer) -> None:
    worker = cluster.decodes[0]
    publisher = RedisRegistry(redis_server.url, key_prefix="test:worker:", summary_prefix="test:cache:")
    reader = RedisRegistry(redis_server.url, key_prefix="test:worker:", summary_prefix="test:cache:")
    await publisher.register(lambda: worker_record(worker.engine, "decode", MODEL, "d-0", worker.address))
    await reader.start()
    try:
        (record,) = reader.workers("decode")
        assert record.cache is not None and not lists(record, PREFIX)
        stub = worker_pb2_grpc.DecodeStub(make_channel(worker.address))
        request = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=PREFIX + [5] * 8,
                                           sampling=sampling_to_worker(SamplingParams(max_tokens=2, seed=0)))
        async for _ in stub.Generate(request, timeout=60):
            pass
        # Written and read every 0.25 s (generous bound for a loaded CPU).
        await wait_for(lambda: lists(reader.workers("decode")[0], PREFIX), 1.5, "the summary in Redis")
        check = aioredis.Redis.from_url(redis_server.url)
        try:
            record_json = json.loads(await check.get("test:worker:d-0"))
            assert set(record_json) == {"role", "address", "model", "fingerprint", "num_free_blocks",
                                        "num_total_blocks", "queue_depth", "worker_id", "updated_at",
                                        "max_model_len", "vocab_size"}  # the record's format, unchanged
            assert await check.exists("test:cache:d-0")
            await publisher.deregister()
            assert not await check.exists("test:worker:d-0", "test:cache:d-0")
        finally:
            await check.aclose()
    finally:
        await publisher.stop()
        await reader.stop()

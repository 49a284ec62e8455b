"""Failures, limits, deadlines and API keys with the services in-process (dummy:tiny, real gRPC on loopback):
the gateway resuming a request on another decode worker, backpressure at the gateway and at decode,
deadlines passed on to prefill, the static registry skipping a draining worker, API keys on gRPC and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.errors import OverloadedError, UnavailableError
from tandem.common.sampling_params import SamplingParams
from tandem.decode_svc.server import create_servicer
from tandem.decode_svc.servicer import DecodeServicer
from tandem.engine.engine import Engine
from tandem.gateway.auth import ApiKeyInterceptor, ApiKeys, parse_api_keys
from tandem.gateway.http_api import create_app, start_http_server
from tandem.gateway.router import Router
from tandem.gateway.server import InfoProbe, load_gateway_model
from tandem.gateway.servicer import GenerationServicer
from tandem.models import load_model_config
from tandem.prefill_svc.servicer import PrefillServicer
from tandem.prefill_svc.servicer import add_to_server as add_prefill_to_server
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.registry import StaticRegistry
from tandem.serving.rpc import make_channel, start_server
from tandem.serving.wire import sampling_to_worker
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

MODEL = "dummy:tiny"
PROMPT = list(range(100, 140))


@dataclass
class Worker:
    engine: AsyncEngine
    servicer: object
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    address: str

    @property
    def is_idle(self) -> bool:
        engine = self.engine.engine
        return engine.num_free_blocks == engine.num_total_blocks


def _config(num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(model=load_model_config(MODEL), cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=512))


async def start_worker(role: str, num_blocks: int = 64, **kwargs: object) -> Worker:
    engine = AsyncEngine(Engine(_config(num_blocks)), name=f"rel-{role}")
    servicer: PrefillServicer | DecodeServicer
    if role == "prefill":
        servicer = PrefillServicer(engine, MODEL)
        add, name = add_prefill_to_server, "tandem.v1.Prefill"
    else:
        servicer = create_servicer(engine, MODEL, **kwargs)  # type: ignore[arg-type]
        add, name = worker_pb2_grpc.add_DecodeServicer_to_server, "tandem.v1.Decode"

    def register(server: grpc.aio.Server) -> list[str]:
        add(servicer, server)  # type: ignore[arg-type]
        return [name]

    server, port, health_servicer = await start_server("127.0.0.1:0", register)
    return Worker(engine, servicer, server, health_servicer, f"127.0.0.1:{port}")


class HangingPrefill(worker_pb2_grpc.PrefillServicer):
    """A prefill worker that never answers; it records the deadline each call arrived with."""

    def __init__(self) -> None:
        self.time_remaining: list[float | None] = []

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse]:
        self.time_remaining.append(context.time_remaining())
        await asyncio.sleep(60)
        yield worker_pb2.PrefillResponse()


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[Worker, list[Worker], Router]]:
    prefill = await start_worker("prefill")
    decodes = [await start_worker("decode") for _ in range(2)]
    registry = StaticRegistry([prefill.address], [d.address for d in decodes])
    router = Router(load_gateway_model(MODEL, 256), registry)
    yield prefill, decodes, router
    await router.close()
    for worker in (prefill, *decodes):
        await worker.server.stop(0)
        worker.engine.close()


def serves(worker: Worker, req_id: str) -> bool:
    """Whether the worker holds the client's request (the gateway adds a suffix per attempt)."""
    return any(key.split("#")[0] == req_id for key in worker.engine.engine.requests)


async def collect(router: Router, req_id: str, params: SamplingParams,
                  kill_after: int | None = None, decodes: list[Worker] | None = None) -> tuple[list[int], str, str]:
    """Token ids, text and finish reason of one routed request; with `kill_after`, the decode worker
    serving it is stopped (calls cancelled, as a dying process's) once that many tokens have arrived."""
    tokens: list[int] = []
    text = ""
    finish = ""
    async with contextlib.aclosing(router.stream(req_id, PROMPT, params, timeout=60)) as chunks:
        async for new_ids, new_text, progress in chunks:
            tokens += new_ids
            text += new_text
            finish = progress.finish_reason or ""
            if kill_after is not None and len(tokens) >= kill_after:
                kill_after = None
                assert decodes is not None
                serving = next(d for d in decodes if serves(d, req_id))
                await serving.server.stop(0)
    return tokens, text, finish


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=48, temperature=0.9, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
async def test_gateway_resumes_on_another_decode_worker_token_exact(
        cluster: tuple[Worker, list[Worker], Router], params: SamplingParams) -> None:
    _, decodes, router = cluster
    expected = await collect(router, "calm", params)
    assert len(expected[0]) == 48 and expected[2] == "length"
    resumed = await collect(router, "storm", params, kill_after=10, decodes=decodes)
    assert resumed == expected  # one uninterrupted stream: same tokens, same text, same end
    survivor = next(d for d in decodes if not serves(d, "storm"))
    for _ in range(100):
        if survivor.is_idle:
            break
        await asyncio.sleep(0.01)
    assert survivor.is_idle


async def test_a_broken_session_resumes_every_request_in_it_token_exact() -> None:
    """The gateway multiplexes its requests to a decode worker over one session: when that worker dies, every
    request in the session resumes on another one, each token-exact, and the client streams see nothing."""
    prefill = await start_worker("prefill")
    # The big worker takes every request (most free blocks per queued request) until it dies; the small one
    # (16 blocks: one full-length request) then runs them all, preempting as it goes.
    big, small = await start_worker("decode", num_blocks=256), await start_worker("decode", num_blocks=16)
    # Probed like the gateway's own registry, so that routing sees each worker's free blocks.
    registry = StaticRegistry([prefill.address], [big.address, small.address], InfoProbe())
    await registry.start()
    router = Router(load_gateway_model(MODEL, 256), registry)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=36, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)]
    try:
        expected = [await collect(router, f"calm-{i}", p) for i, p in enumerate(params)]
        on_big = asyncio.Event()
        num_streamed = [0] * len(params)

        async def one(i: int) -> tuple[list[int], str, str]:
            tokens: list[int] = []
            text = finish = ""
            async with contextlib.aclosing(router.stream(f"storm-{i}", PROMPT, params[i], timeout=60)) as chunks:
                async for new_ids, new_text, progress in chunks:
                    tokens += new_ids
                    text += new_text
                    finish = progress.finish_reason or ""
                    num_streamed[i] = len(tokens)
                    if len(tokens) >= 10 and min(num_streamed) >= 2 and not on_big.is_set():
                        # Every request is under way on the big worker: kill it under all of them.
                        assert all(serves(big, f"storm-{j}") for j in range(len(params)))
                        on_big.set()
                        await big.server.stop(0)
            return tokens, text, finish

        assert await asyncio.gather(*(one(i) for i in range(len(params)))) == expected
        assert on_big.is_set()
        for _ in range(200):
            if small.is_idle:
                break
            await asyncio.sleep(0.01)
        assert small.is_idle
    finally:
        await router.close()
        await registry.stop()
        for worker in (prefill, big, small):
            await worker.server.stop(0)
            worker.engine.close()


async def test_unavailable_only_when_no_decode_worker_is_left(cluster: tuple[Worker, list[Worker], Router]) -> None:
    _, decodes, router = cluster
    for decode in decodes:
        await decode.server.stop(0)
    with pytest.raises(UnavailableError, match="no decode worker left"):
        await collect(router, "nowhere", SamplingParams(max_tokens=4, temperature=0.0))


async def test_gateway_refuses_past_its_concurrency_limit(cluster: tuple[Worker, list[Worker], Router]) -> None:
    _, decodes, _ = cluster
    router = Router(load_gateway_model(MODEL, 256), StaticRegistry([], [decodes[0].address]),
                    max_concurrent_requests=1)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    try:
        first = router.stream("one", PROMPT, params)
        await first.__anext__()
        with pytest.raises(OverloadedError, match="limit of 1"):
            await router.stream("two", PROMPT, params).__anext__()
        await first.aclose()
        assert (await router.stream("three", PROMPT, params).__anext__())[0]  # a slot is free again
    finally:
        await router.close()


async def test_decode_bounds_its_queue_and_passes_its_deadline_to_prefill() -> None:
    hanging = HangingPrefill()

    def register(server: grpc.aio.Server) -> list[str]:
        add_prefill_to_server(hanging, server)
        return ["tandem.v1.Prefill"]

    prefill_server, port, _ = await start_server("127.0.0.1:0", register)
    decode = await start_worker("decode", max_queued=1)
    stub = worker_pb2_grpc.DecodeStub(make_channel(decode.address))
    request = worker_pb2.DecodeRequest(request_id="slow", prompt_token_ids=PROMPT, prefill_address=f"127.0.0.1:{port}",
                                       sampling=sampling_to_worker(SamplingParams(max_tokens=8, seed=1)))
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiting = asyncio.ensure_future(_drain(stub.Generate(request, timeout=1.5)))
        for _ in range(200):  # until the first request is waiting on the prefill worker
            if hanging.time_remaining:
                break
            await asyncio.sleep(0.01)
        request.request_id = "refused"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _drain(stub.Generate(request, timeout=5))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert loop.time() - started < 1.0  # at once, not after the queue moved
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await waiting
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        remaining = hanging.time_remaining[0]
        # The deadline went on to prefill (gRPC re-derives it from a header and its own clock at each hop: on a
        # loaded 2-core machine that read up to ~10 ms over the client's, hence the margin).
        assert remaining is not None and 0 < remaining <= 1.5 + 0.05
        for _ in range(100):
            if decode.is_idle and decode.servicer.runner.num_queued == 0:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.02)
        assert decode.is_idle and decode.servicer.runner.num_queued == 0  # type: ignore[attr-defined]
    finally:
        await prefill_server.stop(0)
        await decode.server.stop(0)
        decode.engine.close()


async def _drain(call: object) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        pass


async def test_static_registry_skips_a_draining_worker() -> None:
    decode = await start_worker("decode")
    probe = InfoProbe()
    try:
        assert await probe("decode", decode.address) is not None
        await decode.health.enter_graceful_shutdown()  # what SIGTERM does first
        assert await probe("decode", decode.address) is None
    finally:
        await decode.server.stop(0)
        decode.engine.close()


def test_api_keys_from_flags_and_environment() -> None:
    assert parse_api_keys(None, {}) == frozenset()
    assert parse_api_keys(["a,b", " c "], {"TANDEM_API_KEYS": "d, ,e"}) == {"a", "b", "c", "d", "e"}
    keys = ApiKeys({"sk-1"})
    assert keys.check([("Authorization", "Bearer sk-1")]) and keys.check([("x-api-key", "sk-1")])
    assert not keys.check([("authorization", "Bearer sk-2")]) and not keys.check([("authorization", "sk-1")])
    assert not keys.check([])
    assert ApiKeys(()).check([])  # off by default


async def test_api_keys_guard_grpc_and_http(cluster: tuple[Worker, list[Worker], Router]) -> None:
    _, _, router = cluster
    keys = ApiKeys({"sk-test"})

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
        return ["tandem.v1.Generation"]

    server, port, _ = await start_server("127.0.0.1:0", register, interceptors=[ApiKeyInterceptor(keys)])
    try:
        async with make_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(prompt="Hello", sampling=generation_pb2.SamplingParams(
                max_tokens=3, temperature=0.0))
            for metadata in [(), (("authorization", "Bearer wrong"),), (("x-api-key", "nope"),)]:
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await _drain(stub.Generate(request, metadata=metadata))
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "sk-test" not in (denied.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await stub.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata)
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for metadata in [(("authorization", "Bearer sk-test"),), (("x-api-key", "sk-test"),)]:
                responses = [r async for r in stub.Generate(request, metadata=metadata)]
                assert responses[-1].usage.completion_tokens >= 1
        http = await start_http_server(create_app(router, keys), "127.0.0.1", 0, grace_s=1.0)
        try:
            base = f"http://127.0.0.1:{http.port}"
            status, body = await asyncio.to_thread(_get, base + "/v1/models", {})
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
            status, _ = await asyncio.to_thread(_get, base + "/v1/models", {"Authorization": "Bearer wrong"})
            assert status == 401
            status, body = await asyncio.to_thread(_get, base + "/v1/models", {"Authorization": "Bearer sk-test"})
            assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
            status, _ = await asyncio.to_thread(_get, base + "/metrics", {})
            assert status == 200  # scrapes need no key
        finally:
            await http.stop()
    finally:
        await server.stop(0)


def _get(url: str, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()

"""Prefill and decode services in-process, over real grpc.aio servers on loopback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.decode_svc.server import create_servicer
from tandem.decode_svc.servicer import DecodeServicer
from tandem.engine.engine import Engine
from tandem.models import load_model_config
from tandem.prefill_svc.servicer import PrefillServicer
from tandem.prefill_svc.servicer import add_to_server as add_prefill_to_server
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.rpc import make_channel, start_server
from tandem.serving.wire import layout_to_proto, sampling_to_worker
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.factories import prompts_for


def engine_config(folder: Path, block_size: int = 4) -> EngineConfig:
    return EngineConfig(model=load_model_config(str(folder), fetch=False),
                        cache=CacheConfig(block_size=block_size, num_blocks=64),
                        scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=256))


@dataclass
class Worker:
    engine: AsyncEngine
    address: str
    server: grpc.aio.Server
    servicer: PrefillServicer | DecodeServicer


async def start_worker(role: str, config: EngineConfig, max_concurrent_streams: int = 256,
                       address: str = "127.0.0.1:0") -> Worker:
    engine = AsyncEngine(Engine(config), name=f"test-{role}")
    servicer: PrefillServicer | DecodeServicer
    if role == "prefill":
        servicer = PrefillServicer(engine, "test")
        add = add_prefill_to_server
    else:
        servicer = create_servicer(engine, "test")
        add = worker_pb2_grpc.add_DecodeServicer_to_server

    def register(server: grpc.aio.Server) -> list[str]:
        add(servicer, server)  # type: ignore[arg-type]
        return [f"tandem.v1.{role.capitalize()}"]

    server, port, _ = await start_server(address, register, max_concurrent_streams=max_concurrent_streams)
    return Worker(engine, f"127.0.0.1:{port}", server, servicer)


def decode_request(req_id: str, prompt: list[int], prefill_address: str, max_tokens: int = 12
                   ) -> worker_pb2.DecodeRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    return worker_pb2.DecodeRequest(request_id=req_id, prompt_token_ids=prompt,
                                    sampling=sampling_to_worker(params), prefill_address=prefill_address)


def reference_tokens(folder: Path, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=256, block_size=4)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outputs]


async def generate(decode: Worker, request: worker_pb2.DecodeRequest) -> tuple[list[int], int]:
    """Token ids of one decode stream, and how many prompt tokens decode prefilled itself."""
    stub = worker_pb2_grpc.DecodeStub(make_channel(decode.address))
    tokens: list[int] = []
    local = 0
    async for response in stub.Generate(request):
        local += response.num_local_prefill_tokens  # computed since the previous message
        tokens += response.token_ids
    return tokens, local


async def test_pages_land_bit_identical_in_the_decode_pool(workers: tuple[Worker, Worker],
                                                           model_folder: Path) -> None:
    prefill, decode = workers
    prompt = prompts_for(512, [37])[0]  # 10 blocks of 4, the last one partial
    # The same prompt prefilled by a colocated engine on the same weights: the expected pages.
    reference = Engine(engine_config(model_folder))
    held = reference.add_request("ref", prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    reference.step()
    expected = [reference.read_pages(held, layer) for layer in range(2)]

    # Read the decode pool at the moment the request joins the batch (pages in, first token known).
    landed: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    engine = decode.engine.engine
    activate = engine.activate

    def capture_then_activate(req_id: str, token_id: int, logprob: float):  # type: ignore[no-untyped-def]
        landed.append([engine.read_pages(engine.requests[req_id], layer) for layer in range(2)])
        return activate(req_id, token_id, logprob)

    engine.activate = capture_then_activate  # type: ignore[method-assign]
    tokens, local = await generate(decode, decode_request("r1", prompt, prefill.address))
    assert local == 0
    assert len(landed) == 1
    for (k, v), (k_ref, v_ref) in zip(landed[0], expected, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert tokens == reference_tokens(model_folder, [prompt])[0]
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_concurrent_requests_match_in_process_generation(workers: tuple[Worker, Worker],
                                                               model_folder: Path) -> None:
    import asyncio

    prefill, decode = workers
    prompts = prompts_for(512, [3, 17, 29, 8, 40])
    results = await asyncio.gather(*(generate(decode, decode_request(f"c{i}", p, prefill.address))
                                     for i, p in enumerate(prompts)))
    assert [tokens for tokens, _ in results] == reference_tokens(model_folder, prompts)
    assert all(local == 0 for _, local in results)


async def test_unreachable_prefill_worker_means_local_prefill(workers: tuple[Worker, Worker],
                                                              model_folder: Path) -> None:
    _, decode = workers
    prompt = prompts_for(512, [21])[0]
    tokens, local = await generate(decode, decode_request("x", prompt, "127.0.0.1:1"))
    assert tokens == reference_tokens(model_folder, [prompt])[0]
    assert local == len(prompt)
    engine = decode.engine.engine
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_mismatched_layout_is_refused(workers: tuple[Worker, Worker], model_folder: Path) -> None:
    prefill, _ = workers
    other = Engine(engine_config(model_folder, block_size=8)).layout
    stub = worker_pb2_grpc.PrefillStub(make_channel(prefill.address))
    params = SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Prefill(worker_pb2.PrefillRequest(
                request_id="m", prompt_token_ids=[5, 6, 7], sampling=sampling_to_worker(params),
                layout=layout_to_proto(other))):
            pass
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: ours 4, theirs 8" in (info.value.details() or "")


async def test_cancel_frees_the_blocks_on_decode(workers: tuple[Worker, Worker]) -> None:
    import asyncio

    prefill, decode = workers
    stub = worker_pb2_grpc.DecodeStub(make_channel(decode.address))
    call = stub.Generate(decode_request("cancel-me", prompts_for(512, [30])[0], prefill.address, max_tokens=90))
    async for _ in call:
        break
    call.cancel()
    engine = decode.engine.engine
    for _ in range(100):
        if engine.num_free_blocks == engine.num_total_blocks:
            break
        await asyncio.sleep(0.01)
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.block_pool.check_integrity()


@pytest.mark.parametrize("remote", [True, False])
async def test_resumed_request_continues_token_exact(workers: tuple[Worker, Worker], model_folder: Path,
                                                     remote: bool) -> None:
    """What the gateway sends when a decode worker died mid-stream: prompt + tokens already streamed."""
    prefill, decode = workers
    prompt = prompts_for(512, [13])[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    llm = LLM(str(model_folder), max_model_len=128, max_num_batched_tokens=256, block_size=4)
    full = llm.generate([prompt], params)[0].token_ids
    request = worker_pb2.DecodeRequest(request_id="resume", prompt_token_ids=prompt,
                                       sampling=sampling_to_worker(params),
                                       prefill_address=prefill.address if remote else "",
                                       output_token_ids=full[:5])
    tokens, local = await generate(decode, request)
    assert tokens == full[5:]
    assert local == (0 if remote else len(prompt) + 5)


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_resumed_request_chunked_on_the_prefill_worker_continues_token_exact(
        model_folder: Path, pipelined: bool) -> None:
    """A resumed request (prompt + tokens already streamed) longer than the prefill worker's step budget: its
    partial steps carry no first token (the tokens already streamed are not one), and it continues exactly."""
    from dataclasses import replace

    config = engine_config(model_folder)
    chunked = replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=16))
    prefill = await start_worker("prefill", chunked)
    prefill.engine.engine.pipeline_prefill = pipelined
    decode = await start_worker("decode", config)
    try:
        prompt = prompts_for(512, [41])[0]
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
        llm = LLM(str(model_folder), max_model_len=128, max_num_batched_tokens=256, block_size=4)
        full = llm.generate([prompt], params)[0].token_ids
        request = worker_pb2.DecodeRequest(request_id="resume-chunked", prompt_token_ids=prompt,
                                           sampling=sampling_to_worker(params), prefill_address=prefill.address,
                                           output_token_ids=full[:5])
        tokens, local = await generate(decode, request)
        assert local == 0
        assert tokens == full[5:]
    finally:
        for worker in (prefill, decode):
            await worker.server.stop(0)
            worker.engine.close()


async def test_a_pipelined_prompts_first_token_does_not_wait_for_the_next_steps_pages(model_folder: Path) -> None:
    """grpc transport, prefill pipelining: prompt A fills step 1, prompt B starts in step 2 (launched before step 1 is
    read). A's first token waits for A's pages only: with B's pages held back in the exporter, A still completes."""
    import asyncio
    import threading
    from dataclasses import replace

    config = engine_config(model_folder)
    prefill = await start_worker("prefill", replace(config, scheduler=replace(config.scheduler,
                                                                              max_num_batched_tokens=16)))
    engine = prefill.engine
    engine.engine.pipeline_prefill = True
    export = prefill.servicer.export  # type: ignore[union-attr]
    deliver = export._deliver
    release_b = threading.Event()

    def held(req_id: str, messages):  # type: ignore[no-untyped-def]
        if req_id == "B":
            release_b.wait(10)
        deliver(req_id, messages)

    export._deliver = held
    gate, gated = threading.Event(), threading.Event()

    def hold(_engine: object) -> None:  # both prompts are queued before the first step
        gated.set()
        gate.wait(10)

    engine.post(hold)
    assert gated.wait(10)  # the engine thread holds: its queue is empty but for what comes next, in order
    stub = worker_pb2_grpc.PrefillStub(make_channel(prefill.address))
    params = SamplingParams(max_tokens=4, temperature=0.0, seed=0)

    async def first_token(req_id: str, prompt: list[int]) -> int:
        async for message in stub.Prefill(worker_pb2.PrefillRequest(
                request_id=req_id, prompt_token_ids=prompt, sampling=sampling_to_worker(params),
                layout=layout_to_proto(engine.engine.layout))):
            if message.HasField("first_token"):
                return message.first_token.token_id
        raise AssertionError("no first token")

    prompt_a, prompt_b = prompts_for(512, [16, 40])
    try:
        tasks = []
        for req_id, prompt in (("A", prompt_a), ("B", prompt_b)):  # queued in this order
            tasks.append(asyncio.ensure_future(first_token(req_id, prompt)))
            for _ in range(500):
                if len(engine._commands) >= len(tasks):
                    break
                await asyncio.sleep(0.01)
        a, b = tasks
        gate.set()
        token_a = await asyncio.wait_for(a, 5)
        assert not b.done()
        release_b.set()
        token_b = await asyncio.wait_for(b, 10)
        assert [token_a, token_b] == [t[0] for t in reference_tokens(model_folder, [prompt_a, prompt_b], 1)]
    finally:
        gate.set()
        release_b.set()
        await prefill.server.stop(0)
        engine.close()

"""The KV handoff's contracts, on the CPU with real workers on loopback:

- a mirrored prefill (what cuda-ipc does on one GPU: the forward stores each layer's K/V into the receiver's
  pages too) leaves exactly the pages a local prefill makes, in the same step that samples the first token;
- pages travel by bytes layer by layer while the forward is still running (the exporter overlaps it);
- a damaged page message is detected, counted, never written, and the request still ends token-exact;
- every prompt token decode computes itself is counted with its reason, also under preemption;
- more concurrent prompts than a prefill worker takes streams on one connection wait for a free one instead of
  being refused (and computed on decode);
- a prefill worker that refuses decode's first connection (not listening yet) gets the prompt once it listens;
- one that comes up late is reached within about a second of listening (gRPC's reconnect backoff capped).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.decode_svc.servicer import DecodeServicer
from tandem.engine.engine import Engine
from tandem.engine.request import KVMirror
from tandem.serving import metrics
from tandem.serving.kv_transfer import PageExporter
from tandem.v1 import worker_pb2
from tests.factories import prompts_for
from tests.services.test_disaggregated import (
    Worker,
    decode_request,
    engine_config,
    generate,
    reference_tokens,
    start_worker,
)


def test_mirrored_prefill_stores_the_same_pages_in_the_same_step(model_folder: Path) -> None:
    engine = Engine(engine_config(model_folder))
    runner = engine.runner
    peer = torch.full_like(runner.kv_cache.tensor, float("nan"))  # the receiver's pool: poisoned
    layers = [(peer[i, 0], peer[i, 1]) for i in range(peer.shape[0])]
    prompts = prompts_for(512, [13, 6])
    targets = [[40, 3, 17, 22], [9, 60]]  # scattered, as a receiver's pool hands them out
    params = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
    requests = [engine.add_request(f"m{i}", p, params, prefill_only=True, kv_mirror=KVMirror(layers, targets[i]))
                for i, p in enumerate(prompts)]
    result = engine.step()  # one step: both prompts computed, first tokens sampled
    assert {r.req_id for r in result.requests} == {"m0", "m1"}
    for request, blocks in zip(requests, targets, strict=True):
        for layer in range(peer.shape[0]):
            k, v = engine.read_pages(request, layer)
            index = torch.tensor(blocks)
            num_tokens = request.num_prompt_tokens
            # Slots past the prompt's last token in the last block are unspecified; the rest must be equal.
            assert torch.equal(peer[layer, 0, index].flatten(0, 1)[:num_tokens], k.flatten(0, 1)[:num_tokens])
            assert torch.equal(peer[layer, 1, index].flatten(0, 1)[:num_tokens], v.flatten(0, 1)[:num_tokens])
    untouched = torch.ones(peer.shape[2], dtype=torch.bool)
    untouched[[b for blocks in targets for b in blocks]] = False
    assert torch.isnan(peer[:, :, untouched]).all()  # nothing written anywhere else


def test_mirror_with_the_wrong_number_of_blocks_is_refused(model_folder: Path) -> None:
    engine = Engine(engine_config(model_folder))
    peer = torch.zeros_like(engine.runner.kv_cache.tensor)
    layers = [(peer[i, 0], peer[i, 1]) for i in range(peer.shape[0])]
    with pytest.raises(ValueError, match="target.block_ids"):
        engine.add_request("x", [5] * 9, SamplingParams(max_tokens=1, seed=0), prefill_only=True,
                           kv_mirror=KVMirror(layers, [1, 2]))  # 9 tokens of block size 4 need 3


def test_pages_leave_while_the_forward_still_runs(model_folder: Path) -> None:
    """The exporter hands layer 0's pages on before the last layer has been computed: the forward waits, at its
    last layer, for layer 0's delivery (which never comes if export only started after the step)."""
    engine = Engine(engine_config(model_folder))
    exporter = PageExporter(engine.runner.kv_cache.tensor)
    delivered = threading.Event()
    num_layers = engine.config.model.num_hidden_layers

    def on_prefill_step(chunks: list) -> object:
        layer_done = exporter.begin_step([(r.req_id, 0, list(r.block_ids)) for r, _, _ in chunks],
                                         lambda req_id, messages: delivered.set())

        def hook(layer: int) -> None:
            layer_done(layer)
            if layer == num_layers - 2:  # before the last layer runs
                assert delivered.wait(timeout=10), "layer 0's pages did not leave during the forward"

        return hook

    engine.on_prefill_step = on_prefill_step  # type: ignore[assignment]
    engine.add_request("o", prompts_for(512, [30])[0], SamplingParams(max_tokens=1, seed=0), prefill_only=True)
    engine.step()
    exporter.close()


async def test_a_damaged_page_message_is_caught_counted_and_recovered(workers: tuple[Worker, Worker],
                                                                     model_folder: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = workers
    import tandem.serving.kv_transfer as kv_transfer

    original = kv_transfer.pages_to_wire

    def damaging(layer: int, k: torch.Tensor, v: torch.Tensor, *args: object,  # type: ignore[no-untyped-def]
                 **kwargs: object):
        for message in original(layer, k, v, *args, **kwargs):  # type: ignore[arg-type]
            if layer == 1:  # flip one byte of layer 1's K in flight
                response = worker_pb2.PrefillResponse.FromString(message.data)
                k_bytes = bytearray(response.pages.k)
                k_bytes[0] ^= 0xFF
                response.pages.k = bytes(k_bytes)
                message = kv_transfer.WirePages(message.layer, message.block_start, message.num_blocks,
                                                response.SerializeToString())
            yield message

    monkeypatch.setattr(kv_transfer, "pages_to_wire", damaging)
    before = metrics.KV_INTEGRITY_FAILURES._value.get()
    written: list[int] = []
    engine = decode.engine.engine
    write_pages = engine.write_pages

    def recording(req_id: str, layer: int, *args: object) -> None:
        written.append(layer)
        write_pages(req_id, layer, *args)  # type: ignore[arg-type]

    engine.write_pages = recording  # type: ignore[method-assign]
    prompt = prompts_for(512, [21])[0]
    tokens, local = await generate(decode, decode_request("dmg", prompt, prefill.address))
    assert metrics.KV_INTEGRITY_FAILURES._value.get() == before + 1
    assert 1 not in written  # the damaged layer never reached the pool
    assert tokens == reference_tokens(model_folder, [prompt])[0]  # recovered: computed here instead
    assert local == len(prompt)
    for _ in range(100):
        if engine.num_free_blocks == engine.num_total_blocks:
            break
        await asyncio.sleep(0.01)
    assert engine.num_free_blocks == engine.num_total_blocks


def _local_tokens(reason: str) -> float:
    return metrics.LOCAL_PREFILL_TOKENS.labels(reason=reason)._value.get()


async def test_every_locally_computed_prompt_token_is_counted_with_its_reason(model_folder: Path) -> None:
    """A decode pool too small for all requests at once, a live prefill worker: requests are preempted and
    recomputed here; the responses and the metric count exactly what decode computed, by reason."""
    prefill = await start_worker("prefill", engine_config(model_folder))
    config = engine_config(model_folder)
    # 96 token slots for 4 requests of ~50 tokens each.
    small = EngineConfig(model=config.model, cache=CacheConfig(block_size=4, num_blocks=24),
                         scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=256))
    decode = await start_worker("decode", small)
    try:
        prompts = prompts_for(512, [20, 22, 18, 24])
        before = {reason: _local_tokens(reason) for reason in ("preemption", "transfer_failed", "no_prefill_worker")}
        results = await asyncio.gather(*(generate(decode, decode_request(f"p{i}", p, prefill.address, max_tokens=30))
                                         for i, p in enumerate(prompts)))
        preempted = _local_tokens("preemption") - before["preemption"]
        assert preempted > 0, "the small pool should have preempted"
        # What the responses report computed locally is what the metric counted.
        reported = sum(local for _, local in results)
        assert reported == preempted + sum(_local_tokens(r) - before[r] for r in ("transfer_failed",
                                                                                    "no_prefill_worker"))
        assert [tokens for tokens, _ in results] == reference_tokens(model_folder, prompts, max_tokens=30)
    finally:
        for worker in (prefill, decode):
            await worker.server.stop(0)
            worker.engine.close()


async def test_pulls_past_the_prefill_workers_stream_limit_wait_instead_of_falling_back(
        model_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill worker that takes 4 streams per connection, 8 prompts at once: gRPC's client refuses the calls past
    the peer's limit (UNAVAILABLE) rather than waiting, and each refused prompt was computed on decode. Decode opens
    at most `MAX_PULLS_PER_PEER` calls to one peer (2 here); the rest wait, and every prompt comes from the prefill
    worker, token-exact."""
    import tandem.decode_svc.kv_pull as kv_pull

    monkeypatch.setattr(kv_pull, "MAX_PULLS_PER_PEER", 2)
    prefill = await start_worker("prefill", engine_config(model_folder), max_concurrent_streams=4)
    decode = await start_worker("decode", engine_config(model_folder))
    try:
        prompts = prompts_for(512, [9, 11, 10, 12, 9, 13, 10, 11])
        before = _local_tokens("transfer_failed")
        results = await asyncio.gather(*(generate(decode, decode_request(f"s{i}", p, prefill.address, max_tokens=4))
                                         for i, p in enumerate(prompts)))
        assert [local for _, local in results] == [0] * len(prompts)
        assert _local_tokens("transfer_failed") == before
        assert [tokens for tokens, _ in results] == reference_tokens(model_folder, prompts, max_tokens=4)
    finally:
        for worker in (prefill, decode):
            await worker.server.stop(0)
            worker.engine.close()


async def test_a_prefill_worker_that_refuses_the_first_connection_still_gets_the_prompt(model_folder: Path) -> None:
    """The prefill worker's port refuses connections when decode's pull starts and listens 0.3 s later: the call,
    never sent, is tried again once the channel connects, and no prompt token is computed on decode."""
    from tandem.launcher import free_port

    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    decode = await start_worker("decode", engine_config(model_folder))
    workers = [decode]
    try:
        prompt = prompts_for(512, [10])[0]
        before = _local_tokens("transfer_failed")
        pending = asyncio.ensure_future(generate(decode, decode_request("late", prompt, address, max_tokens=4)))
        await asyncio.sleep(0.3)
        workers.append(await start_worker("prefill", engine_config(model_folder), address=address))
        tokens, local = await asyncio.wait_for(pending, 30)
        assert local == 0 and _local_tokens("transfer_failed") == before
        assert tokens == reference_tokens(model_folder, [prompt], max_tokens=4)[0]
    finally:
        for worker in workers:
            await worker.server.stop(0)
            worker.engine.close()


async def test_a_prefill_worker_that_comes_up_late_is_reached_within_a_second(model_folder: Path) -> None:
    """Decode's warm start asks a prefill worker that is not up for 12 s (as one that maps decode's weights starts
    after it): once it listens, decode learns it within ~1 s, and a request then goes to it with no prompt token
    computed on decode. With gRPC's default backoff (1 s growing 1.6x, +-20%) the attempt after 12 s comes 12.6-19 s
    in (6.6 s after listening when measured)."""
    from tandem.launcher import free_port

    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    decode = await start_worker("decode", engine_config(model_folder))
    workers = [decode]
    try:
        assert isinstance(decode.servicer, DecodeServicer)
        connecting = asyncio.ensure_future(decode.servicer.runner.puller.connect(address, interval_s=0.25))
        await asyncio.sleep(12.0)
        assert not connecting.done()
        workers.append(await start_worker("prefill", engine_config(model_folder), address=address))
        listening = time.monotonic()
        assert await asyncio.wait_for(connecting, 10)
        assert time.monotonic() - listening < 2.5
        prompt = prompts_for(512, [11])[0]
        tokens, local = await asyncio.wait_for(generate(decode, decode_request("late2", prompt, address, max_tokens=4)),
                                               30)
        assert local == 0
        assert tokens == reference_tokens(model_folder, [prompt], max_tokens=4)[0]
    finally:
        for worker in workers:
            await worker.server.stop(0)
            worker.engine.close()

"""Prefix caching across the handoff, with real prefill and decode workers on loopback: the decode worker tells
the prefill worker which leading blocks it holds, and only the missing pages travel; a prompt the decode worker
holds whole needs no prefill worker; a prefix only the prefill worker holds is shipped without being computed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem.serving import metrics
from tandem.serving.rpc import make_channel
from tandem.v1 import worker_pb2_grpc
from tests.factories import prompts_for
from tests.services.test_disaggregated import Worker, decode_request, reference_tokens

BLOCK = 4  # engine_config's block size


async def _generate(decode: Worker, request: object) -> tuple[list[int], int, int]:
    """Tokens, prompt tokens computed on decode, prompt tokens decode found in its cache."""
    stub = worker_pb2_grpc.DecodeStub(make_channel(decode.address))
    tokens: list[int] = []
    local = cached = 0
    async for response in stub.Generate(request):
        tokens += response.token_ids
        local += response.num_local_prefill_tokens
        cached += response.num_cached_tokens
    return tokens, local, cached


def _bytes() -> float:
    return metrics.KV_TRANSFER_BYTES._value.get()


async def test_only_the_missing_pages_travel(workers: tuple[Worker, Worker], model_folder: Path) -> None:
    prefill, decode = workers
    prefix = prompts_for(512, [40])[0]  # 10 full blocks
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15, 16]
    before = _bytes()
    tokens, local, cached = await _generate(decode, decode_request("p1", first, prefill.address))
    assert (local, cached) == (0, 0)
    full_transfer = _bytes() - before  # counted by both workers (one process hosts both here)
    before = _bytes()
    tokens2, local2, cached2 = await _generate(decode, decode_request("p2", second, prefill.address))
    assert cached2 == 40 and local2 == 0
    assert _bytes() - before < full_transfer / 3  # 3 blocks instead of 11
    assert [tokens, tokens2] == reference_tokens(model_folder, [first, second])


async def test_a_prompt_held_whole_needs_no_prefill_worker(workers: tuple[Worker, Worker],
                                                           model_folder: Path) -> None:
    prefill, decode = workers
    prompt = prompts_for(512, [33])[0]
    await _generate(decode, decode_request("w1", prompt, prefill.address))
    prefill_tokens = metrics.PREFILL_PROMPT_TOKENS._value.get()
    tokens, local, cached = await _generate(decode, decode_request("w2", prompt, prefill.address))
    assert cached == 32 and local == 1  # the last token only, computed here
    assert metrics.PREFILL_PROMPT_TOKENS._value.get() == prefill_tokens  # the prefill worker did nothing
    assert tokens == reference_tokens(model_folder, [prompt])[0]


async def test_a_prefix_cached_only_on_the_prefill_worker_is_shipped(workers: tuple[Worker, Worker],
                                                                     model_folder: Path) -> None:
    prefill, decode = workers
    prefix = prompts_for(512, [24])[0]
    first, second = prefix + [5, 6], prefix + [9, 10, 11]
    await _generate(decode, decode_request("c1", first, prefill.address))
    decode.engine.post(lambda e: e.block_pool.reset_cache())  # decode forgets; prefill still holds the prefix
    prefill_tokens = metrics.PREFILL_PROMPT_TOKENS._value.get()
    tokens, local, cached = await _generate(decode, decode_request("c2", second, prefill.address))
    assert (local, cached) == (0, 0)
    assert metrics.PREFILL_PROMPT_TOKENS._value.get() - prefill_tokens == 3  # only the new tail was computed
    assert tokens == reference_tokens(model_folder, [second])[0]


async def test_concurrent_requests_share_a_prefix_in_flight(workers: tuple[Worker, Worker],
                                                            model_folder: Path) -> None:
    """Two requests with the same prefix at once: the second is reserved while the first's pages are on their way,
    shares those blocks (counted as cached) and receives only its tail; both give the reference tokens."""
    prefill, decode = workers
    other, prefix = prompts_for(509, [40, 40])  # a prefix of 10 blocks, and one nobody else uses
    before = _bytes()
    await _generate(decode, decode_request("f0", other + [21, 22, 23], prefill.address))
    eleven_blocks = _bytes() - before
    prompts = [prefix + [21, 22, 23], prefix + [31, 32, 33, 34, 35]]  # 11 and 12 blocks, 10 of them shared
    before = _bytes()
    results = await asyncio.gather(*(_generate(decode, decode_request(f"f{i + 1}", p, prefill.address))
                                     for i, p in enumerate(prompts)))
    assert sorted(cached for _, _, cached in results) == [0, 40]
    assert all(local == 0 for _, local, _ in results)
    assert _bytes() - before == pytest.approx(eleven_blocks * 13 / 11)  # 11 + 2 blocks travelled, not 11 + 12
    assert [tokens for tokens, _, _ in results] == reference_tokens(model_folder, prompts)

"""KV-aware routing on the CPU, no sockets: what workers publish about their prefix cache (the block pool's summary,
its wire and registry forms), how the gateway scores workers by it (cost, fallback, its own placements counted at
once, stale summaries replaced), and cached tokens in the OpenAI API's usage."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import openai
import pytest

from tandem import LLM
from tandem.common.prefix_cache import block_hashes
from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.gateway.http_api import create_app
from tandem.gateway.kv_routing import OFFLOAD_BLOCKS, KVRouter, KVRoutingConfig, PromptBlocks
from tandem.gateway.router import Completion
from tandem.serving.registry import CacheSummary, StaticRegistry, WorkerRecord, prefix_of
from tandem.serving.worker import cache_summary
from tandem.v1 import worker_pb2
from tests.factories import prompts_for, save_random_hf_model
from tests.unit.test_http_api import MODEL, FakeRouter

BLOCK = 4
KEY = b"fingerprint"
T = TypeVar("T")


class FirstOfTies(random.Random):
    """Picks the first of equal candidates: a tie is then decided by the order, never by luck."""

    def choice(self, seq: Sequence[T]) -> T:
        return seq[0]


def tokens(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(num_tokens)]


def summary(token_lists: Sequence[list[int]] = (), *, taken_at: float = 0.0) -> CacheSummary:
    """A worker's summary holding the full blocks of each token list."""
    prefixes = b"".join(h[:8] for ids in token_lists for h in block_hashes(ids, BLOCK, KEY))
    return CacheSummary(BLOCK, KEY, prefixes, len(prefixes) // 8, taken_at)


def worker(address: str, *, free: int = 100, queue: int = 0, cache: CacheSummary | None = None,
           role: str = "decode", fingerprint: str = "fp", updated_at: float = 0.0) -> WorkerRecord:
    return WorkerRecord(role=role, address=address, model=MODEL, fingerprint=fingerprint, num_free_blocks=free,
                        num_total_blocks=100, queue_depth=queue, worker_id=address, updated_at=updated_at,
                        cache=cache if cache is not None else summary())


def router(**config: Any) -> KVRouter:
    return KVRouter(KVRoutingConfig(**config), rng=FirstOfTies())


# -- what a worker publishes -------------------------------------------------------------------------------


def test_pool_summary_lists_every_cached_block_and_when_capped_the_held_then_the_most_recent() -> None:
    pool = BlockPool(8)
    hashes = block_hashes(list(range(6 * BLOCK)), BLOCK, KEY)
    held = pool.allocate(6)
    for block_id, block_hash in zip(held, hashes, strict=True):
        pool.cache_full_block(block_id, block_hash)
    pool.allocate(1)  # held, never cached: not listed
    pool.free(held[:4])  # evictable now; freed in order, so the first block is the most recently used
    listed = pool.cached_hash_prefixes(100)
    assert sorted(listed[i:i + 8] for i in range(0, len(listed), 8)) == sorted(h[:8] for h in hashes)
    capped = pool.cached_hash_prefixes(4)
    assert [capped[i:i + 8] for i in range(0, 32, 8)] == [h[:8] for h in (hashes[4], hashes[5], hashes[0], hashes[1])]
    pool.check_integrity()  # read-only
    assert pool.cached_hash_prefixes(0) == b""


def test_summary_travels_as_proto_and_stays_out_of_the_json_record() -> None:
    original = summary([tokens(1, 12)], taken_at=5.0)
    message = worker_pb2.WorkerInfo(prefix_cache=original.to_proto())
    assert CacheSummary.from_proto(message.prefix_cache) == original
    assert CacheSummary.from_bytes(original.to_proto().SerializeToString()) == original
    assert original.prefixes == {prefix_of(h) for h in block_hashes(tokens(1, 12), BLOCK, KEY)}
    # A worker with its cache off (no hash key), or older than summaries, publishes none.
    assert CacheSummary.from_proto(worker_pb2.WorkerInfo().prefix_cache) is None
    with pytest.raises(ValueError, match="malformed"):
        CacheSummary.from_proto(worker_pb2.PrefixCacheSummary(block_size=4, hash_key=KEY, block_hash_prefixes=b"x"))
    with pytest.raises(ValueError, match="unparsable"):
        CacheSummary.from_bytes(b"\xff\xff\xff")
    # The Redis record keeps its format: same keys as before, and a record with a summary parses back without it.
    record = worker("d0", cache=original)
    assert "cache" not in record.to_json() and WorkerRecord.from_json(record.to_json()) == record
    assert WorkerRecord.from_json(record.to_json()).cache is None


def test_a_worker_publishes_its_cache_as_the_gateway_names_blocks_and_nothing_when_it_is_off(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    prompt = prompts_for(512, [41])[0]
    llm = LLM(str(tmp_path), max_model_len=128, block_size=BLOCK)
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    published = cache_summary(llm.engine)
    assert published is not None and published.block_size == BLOCK
    assert published.hash_key == llm.engine.layout.fingerprint().encode()
    assert published.num_cached_blocks == llm.engine.block_pool.num_cached_blocks >= 10
    # The gateway, hashing the prompt on its own, finds every block the worker would look up.
    assert router().matched_blocks(worker("w", cache=published), PromptBlocks(prompt)) == 10
    # Taken at most once per SUMMARY_MAX_AGE_S however many ask (every gateway process probes every worker).
    assert cache_summary(llm.engine) is published
    llm.generate([prompts_for(512, [41, 41])[1]], SamplingParams(max_tokens=1, temperature=0.0))  # other blocks
    assert cache_summary(llm.engine) is published
    retaken = cache_summary(llm.engine, max_age_s=0.0)
    assert retaken is not published and retaken.num_cached_blocks > published.num_cached_blocks
    assert retaken.taken_at >= published.taken_at
    off = LLM(str(tmp_path), max_model_len=128, block_size=BLOCK, enable_prefix_caching=False)
    off.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert cache_summary(off.engine) is None


async def test_static_registry_keeps_an_unchanged_summary_and_replaces_a_changed_one() -> None:
    answers = [summary([tokens(1, 8)]), summary([tokens(1, 8)]), summary([tokens(2, 8)])]

    async def probe(role: str, address: str) -> WorkerRecord:
        return worker(address, cache=answers[0])

    registry = StaticRegistry([], ["127.0.0.1:2"], probe, refresh_s=60.0)
    await registry.refresh()
    first = registry.workers("decode")[0].cache
    answers.pop(0)
    await registry.refresh()  # equal content: the same object, its parsed set kept
    assert registry.workers("decode")[0].cache is first
    answers.pop(0)
    await registry.refresh()
    assert registry.workers("decode")[0].cache == answers[0]


# -- the cost ----------------------------------------------------------------------------------------------


def test_the_worker_holding_the_prefix_wins_unless_the_other_has_much_more_room() -> None:
    prompt = tokens(1, 41)  # 10 blocks to look up
    holder = summary([prompt[:40]])
    kv = router()
    # 10 blocks saved at weight 2 outweigh 15 blocks less headroom...
    choice = kv.choose([worker("b", free=100), worker("a", free=85, cache=holder)], PromptBlocks(prompt), "decode")
    assert choice.worker.address == "a" and choice.is_cache_aware and choice.matched_blocks == 10
    assert "cache-aware: 10/10" in choice.reason
    assert [(c.worker.address, c.matched_blocks, c.cost) for c in choice.candidates] == [("a", 10, -85), ("b", 0, -80)]
    # ... but not 25, nor a queued request (headroom is free blocks per queued request).
    assert kv.choose([worker("b", free=100), worker("a", free=75, cache=holder)], PromptBlocks(prompt),
                     "decode").worker.address == "b"
    assert kv.choose([worker("b", free=100), worker("a", free=100, queue=1, cache=holder)], PromptBlocks(prompt),
                     "decode").worker.address == "b"


def test_a_poor_match_falls_back_to_the_least_loaded() -> None:
    prompt = tokens(1, 41)
    one_block = summary([prompt[:4]])  # 1 of 10 blocks: under 20%
    choice = router(min_match_share=0.2).choose([worker("a", free=95, cache=one_block), worker("b", free=96)],
                                                PromptBlocks(prompt), "decode")
    assert choice.worker.address == "b" and not choice.is_cache_aware
    assert "least loaded" in choice.reason and "1/10" in choice.reason
    # With a lower bar the same match counts (and here outweighs one block of headroom).
    assert router(min_match_share=0.1).choose([worker("a", free=95, cache=one_block), worker("b", free=96)],
                                              PromptBlocks(prompt), "decode").worker.address == "a"


def test_only_the_leading_blocks_count_and_never_the_last_token() -> None:
    prompt = tokens(1, 40)
    kv = router()
    # Everything but the first block cached: nothing usable (a block is useless without its parents).
    no_head = CacheSummary(BLOCK, KEY, b"".join(h[:8] for h in block_hashes(prompt, BLOCK, KEY)[1:]), 9, 0.0)
    assert kv.matched_blocks(worker("a", cache=no_head), PromptBlocks(prompt)) == 0
    # All 10 blocks cached: 9 count, as the worker computes at least the prompt's last token.
    assert kv.matched_blocks(worker("a", cache=summary([prompt])), PromptBlocks(prompt)) == 9
    # Another hash key (another model or KV layout) names other blocks.
    other_key = replace(summary([prompt]), hash_key=b"other")
    assert kv.matched_blocks(worker("a", cache=other_key), PromptBlocks(prompt)) == 0


def test_the_prefill_worker_is_chosen_the_same_way_among_those_of_the_decode_fingerprint() -> None:
    prompt = tokens(1, 41)
    holder = summary([prompt[:40]])
    decodes = [worker("d", fingerprint="fp")]
    prefills = [worker("p-other", role="prefill", fingerprint="other", cache=holder, free=100),
                worker("p-cold", role="prefill", free=90), worker("p-warm", role="prefill", free=80, cache=holder)]
    prefill, decode = router().choose_pair(prefills, decodes, PromptBlocks(prompt))
    assert decode.worker.address == "d"
    assert prefill is not None and prefill.worker.address == "p-warm" and prefill.matched_blocks == 10
    prefill, _ = router().choose_pair(prefills[:1], decodes, PromptBlocks(prompt))
    assert prefill is None  # no prefill worker of its layout: decode prefills locally


# -- what the gateway knows before the workers say so -------------------------------------------------------


def test_own_placements_count_at_once_for_the_blocks() -> None:
    """A request sharing a prefix with one placed moments ago follows it, before any summary lists the blocks."""
    prompt, follower = tokens(1, 40) + [1], tokens(1, 40) + [2, 3]
    kv = router()
    a, b = worker("a", free=100), worker("b", free=100)
    assert kv.choose([a, b], PromptBlocks(prompt), "decode").worker.address == "a"  # a tie: the first
    kv.place(a, PromptBlocks(prompt))
    # Both report again, a with the placed request's blocks reserved but not yet cached (its pages are on their
    # way): by load alone b wins; the placement says a holds the prefix.
    now = time.time() + 1
    a, b = worker("a", free=89, updated_at=now, cache=summary()), worker("b", free=100, updated_at=now)
    choice = kv.choose([b, a], PromptBlocks(follower), "decode")
    assert choice.worker.address == "a" and choice.matched_blocks == 10
    assert router().choose([b, a], PromptBlocks(follower), "decode").worker.address == "b"  # without the placement


def test_own_placements_count_at_once_as_load() -> None:
    """A burst (no record in between) spreads over equal workers instead of piling onto the first."""
    kv = router()
    workers = [worker(name, free=100) for name in "abcd"]
    chosen = []
    for i in range(4):
        prompt = PromptBlocks(tokens(i, 41))
        choice = kv.choose(workers, prompt, "decode")
        kv.place(choice.worker, prompt)
        chosen.append(choice.worker.address)
    assert sorted(chosen) == ["a", "b", "c", "d"]
    # A record taken after the placements replaces them: the load is the worker's own report from then on.
    later = [replace(w, updated_at=time.time() + 1) for w in workers]
    assert [kv.headroom(w) for w in later] == [100.0] * 4


def test_a_summary_that_lists_the_placed_blocks_replaces_the_placement_and_a_later_one_can_drop_them() -> None:
    prompt = tokens(1, 41)
    kv = router()
    a = worker("a")
    kv.place(a, PromptBlocks(prompt))
    listed = worker("a", cache=summary([prompt[:40]]))
    assert kv.matched_blocks(listed, PromptBlocks(prompt)) == 10
    evicted = worker("a", cache=summary())  # the worker evicted them since: the stale knowledge goes too
    assert kv.matched_blocks(evicted, PromptBlocks(prompt)) == 0


def test_stale_summaries_are_replaced_whole() -> None:
    old, new = tokens(1, 41), tokens(2, 41)
    kv = router()
    assert kv.matched_blocks(worker("a", cache=summary([old[:40]])), PromptBlocks(old)) == 10
    fresh = worker("a", cache=summary([new[:40]]))
    assert kv.matched_blocks(fresh, PromptBlocks(old)) == 0
    assert kv.matched_blocks(fresh, PromptBlocks(new)) == 10


def test_a_placement_no_summary_confirms_lapses() -> None:
    prompt = tokens(1, 41)
    kv = router(placement_ttl_s=0.05)
    a = worker("a")
    kv.place(a, PromptBlocks(prompt))
    assert kv.matched_blocks(a, PromptBlocks(prompt)) == 10
    time.sleep(0.1)
    assert kv.matched_blocks(a, PromptBlocks(prompt)) == 0
    assert kv.headroom(a) == 100.0


def test_pending_placements_are_bounded() -> None:
    kv = router(max_pending_blocks=15)
    a = worker("a")
    first, second = tokens(1, 41), tokens(2, 41)
    kv.place(a, PromptBlocks(first))
    kv.place(a, PromptBlocks(second))
    assert kv.matched_blocks(a, PromptBlocks(second)) == 10
    assert kv.matched_blocks(a, PromptBlocks(first)) == 0  # its first blocks were the oldest: forgotten


# -- cached tokens in the OpenAI API's usage ----------------------------------------------------------------


class CachingRouter(FakeRouter):
    """The fake router, reporting that decode found the prompt's first 3 tokens cached."""

    async def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     timeout: float | None = None, trace_context: Any = None,
                     ) -> AsyncGenerator[tuple[list[int], str, Completion], None]:
        async for new_ids, text, progress in super().stream(request_id, prompt_ids, params, timeout, trace_context):
            progress.num_cached_tokens = 3
            yield new_ids, text, progress


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx2.ASGITransport(app=create_app(CachingRouter()))
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


async def test_usage_reports_cached_tokens_streamed_or_not(client: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 3
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True})]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3
    # Completions: each prompt counted once, however many samples it has.
    completion = await client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=2, n=2)
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 6
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt="one", max_tokens=2, stream=True, stream_options={"include_usage": True})]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3


async def test_a_long_prompt_is_hashed_off_the_event_loop() -> None:
    threads: list[threading.Thread] = []

    class Recorded(PromptBlocks):
        def hash(self, keys: set[tuple[int, bytes]]) -> None:
            threads.append(threading.current_thread())
            super().hash(keys)

    gateway = FakeRouter()
    try:
        await gateway._hash(Recorded(tokens(1, BLOCK * (OFFLOAD_BLOCKS + 1))), [worker("a")])
        await gateway._hash(Recorded(tokens(1, BLOCK * OFFLOAD_BLOCKS)), [worker("a")])
    finally:
        await gateway.close()
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()

"""The prefix cache in the engine: prompts that share full blocks reuse their K/V instead of computing them, and
the output is the same as without the cache (greedy and seeded), under chunking and preemption."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.common.config import SchedulerConfig
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler
from tests.factories import hf_greedy, prompts_for, save_random_hf_model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_shared_prefix_is_reused_and_changes_nothing(tmp_path: Path) -> None:
    hf = save_random_hf_model(tmp_path)
    system = prompts_for(512, [40])[0]  # a shared "system prompt": 5 full blocks of 8
    tails = prompts_for(500, [7, 13, 3])
    prompts = [system + tail for tail in tails]
    cached = LLM(str(tmp_path), max_model_len=128, block_size=8)
    first = cached.generate(prompts[:1], greedy(10))[0]
    later = cached.generate(prompts[1:], greedy(10))
    assert [o.token_ids for o in [first, *later]] == [hf_greedy(hf, p, 10) for p in prompts]
    engine = cached.engine
    stats = engine.block_pool.prefix_cache_stats
    assert stats.num_hit_tokens >= 2 * 40  # both later requests found the 40-token prefix
    assert engine.num_free_blocks == engine.num_total_blocks  # cached blocks count as free (evictable)
    assert engine.block_pool.num_cached_blocks > 0
    engine.block_pool.check_integrity()


def test_reuse_with_other_sampling_gives_a_cold_runs_tokens(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    prompt = prompts_for(512, [50])[0]
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    cold = LLM(str(tmp_path), max_model_len=128, block_size=4, enable_prefix_caching=False)
    expected = cold.generate([prompt], seeded)[0].token_ids
    warm = LLM(str(tmp_path), max_model_len=128, block_size=4)
    warm.generate([prompt], greedy(5))  # fills the cache with the prompt's blocks
    assert warm.generate([prompt], seeded)[0].token_ids == expected
    assert warm.engine.block_pool.prefix_cache_stats.num_hit_tokens >= 48


def test_requests_in_flight_share_blocks_and_chunks_use_the_cache(tmp_path: Path) -> None:
    """Concurrent requests with one prefix, a budget that chunks the prompts and a pool that preempts: the same
    tokens as without the cache, and every block back in the end."""
    hf = save_random_hf_model(tmp_path)
    prefix = prompts_for(512, [48])[0]
    prompts = [prefix + tail for tail in prompts_for(300, [5, 9, 2, 11])]
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=24, block_size=8, num_kv_blocks=24)
    outputs = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 16) for p in prompts]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    llm.engine.block_pool.check_integrity()


def _run(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    if output is not None:
        num = sum(output.samples(i) for i in range(len(output.requests)))
        scheduler.update_from_output(output, [5] * num, [0.0] * num)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 32), budget=st.integers(1, 48))
def test_random_mix_with_shared_prefixes_keeps_the_pool_whole(seed: int, num_blocks: int, budget: int) -> None:
    """Prompts drawn from a few shared prefixes, chunked steps, aborts and preemption: held blocks are never handed
    out twice, the pool stays whole, and every request not aborted finishes."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget)
    scheduler = Scheduler(config, BlockPool(num_blocks), 4, (2,), prefix_key=b"test")
    prefixes = [[10 + i] * rng.randint(0, 12) for i in range(3)]
    live: list[Request] = []
    for step in range(80):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randint(3, 99) for _ in range(rng.randint(1, 6))]
            request = Request(req_id=f"r{step}", prompt_token_ids=prompt,
                              params=SamplingParams(max_tokens=rng.randint(1, 8)), seed=0)
            scheduler.add(request)
            live.append(request)
        if live and rng.random() < 0.1:
            scheduler.finish(live.pop(rng.randrange(len(live))), RequestStatus.FINISHED_ABORTED)
        _run(scheduler)
        held = [b for r in scheduler.running for b in r.block_ids]
        for block in set(held):
            assert scheduler.block_pool.ref_count(block) == held.count(block)
        scheduler.block_pool.check_integrity()
        live = [r for r in live if not r.status.is_finished]
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        _run(scheduler)
    assert all(r.status.is_finished for r in live)
    scheduler.block_pool.check_integrity()
    assert scheduler.block_pool.num_free_blocks == num_blocks


def test_accepted_proposals_across_a_block_boundary_are_cached_once_they_are_tokens() -> None:
    """A verify step whose accepted run fills a block: the block is registered under the hash of its tokens (the
    proposals are counted as computed a moment before they become tokens), and the rejected tail's block freed."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler = Scheduler(config, BlockPool(16), 4, (2,), prefix_key=b"test")
    request = Request(req_id="s", prompt_token_ids=[10, 11, 12, 13, 14, 15], params=SamplingParams(max_tokens=20),
                      seed=0)
    scheduler.add(request)
    _run(scheduler)  # prefill: 6 tokens, first token sampled (5)
    request.spec_token_ids = [21, 22, 23, 24]  # verify 1 + 4 tokens at positions 6..10
    output = scheduler.schedule()
    assert output is not None and output.num_spec_tokens(0) == 4
    # Two proposals accepted, then the target's own token: 3 tokens emitted.
    scheduler.update_from_output(output, [[21, 22, 30]], [[0.0, 0.0, 0.0]])
    assert request.output_token_ids == [5, 21, 22, 30]
    assert request.num_computed_tokens == 9  # 6 prompt + the last token + 2 accepted
    assert request.num_registered_blocks == 2  # tokens 0..7 form two full blocks
    assert len(request.block_ids) == 3  # blocks up to its 10 tokens; the rejected tail's block is gone
    scheduler.block_pool.check_integrity()

"""Prefix blocks in flight (decode role): a request reserved while another's pages for the same prefix are still on
their way shares those blocks instead of receiving them again, and activates only after that request; if it fails
or ends first, the sharer computes its prompt here. Two engines on the CPU stand for the prefill and decode workers
(pages moved by `read_pages` / `write_pages`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import SamplingParams
from tandem.common.config import EngineConfig, SchedulerConfig
from tandem.engine.block_pool import BlockPool
from tandem.engine.engine import Engine
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.models import load_model_config
from tests.factories import hf_greedy, prompts_for, save_random_hf_model

BLOCK = 8
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("model")
    return path, save_random_hf_model(path)


def engines(path: Path) -> tuple[Engine, Engine]:
    config = EngineConfig.create(load_model_config(str(path)), max_model_len=128, block_size=BLOCK)
    return Engine(config), Engine(config)


def prefill_and_ship(prefill: Engine, decode: Engine, req_id: str, prompt: list[int]) -> tuple[int, float]:
    """The prefill worker's part for a request decode has reserved: compute the prompt, ship the pages decode lacks
    (past its `num_cached_tokens`); returns the first token and its logprob."""
    receiver = decode.requests[req_id]
    sent = prefill.add_request(req_id, prompt, PARAMS, prefill_only=True,
                               receiver_cached_tokens=receiver.num_cached_tokens)
    while sent.status is not RequestStatus.PREFILLED:
        prefill.step()
    start = receiver.num_cached_tokens // BLOCK
    for layer in range(decode.layout.num_layers):
        k, v = prefill.read_pages(sent, layer)
        decode.write_pages(req_id, layer, start, k[start:], v[start:])
    prefill.release(req_id)
    return sent.output_token_ids[0], sent.output_logprobs[0]


def run_to_end(decode: Engine) -> None:
    while decode.has_unfinished():
        decode.step()


def two_prompts() -> tuple[list[int], list[int]]:
    prefix = prompts_for(512, [40])[0]  # 5 full blocks
    return prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15, 16]


def test_a_later_reservation_shares_the_blocks_in_flight_and_waits_for_them(model: tuple[Path, object]) -> None:
    path, hf = model
    prefill, decode = engines(path)
    first, second = two_prompts()
    a = decode.add_request("a", first, PARAMS, remote_prefill=True)
    b = decode.add_request("b", second, PARAMS, remote_prefill=True)
    assert decode.step().reserved == [a, b]
    # b shares a's five prefix blocks, not yet written: only its own tail is to come, and it waits for a.
    assert b.block_ids[:5] == a.block_ids[:5] and b.num_cached_tokens == 40 and b.waits_for == {"a"}
    assert decode.block_pool.prefix_cache_stats.num_hit_tokens == 40
    # b's pages land first: it waits (nothing to publish) ...
    assert decode.activate("b", *prefill_and_ship(prefill, decode, "b", second)) == []
    assert b.status is RequestStatus.WAITING_FOR_KV
    # ... and joins when a does.
    assert decode.activate("a", *prefill_and_ship(prefill, decode, "a", first)) == [a, b]
    run_to_end(decode)
    assert [a.output_token_ids, b.output_token_ids] == [hf_greedy(hf, p, 6) for p in (first, second)]
    assert decode.num_free_blocks == decode.num_total_blocks and not decode.scheduler.pending
    decode.block_pool.check_integrity()


def test_a_chain_of_sharers_activates_in_order(model: tuple[Path, object]) -> None:
    """c shares blocks of a and of b (b's tail continues a's prefix): it waits for both."""
    path, hf = model
    prefill, decode = engines(path)
    base = prompts_for(512, [24])[0]
    prompts = [base + [3], base + list(range(40, 57)), base + list(range(40, 57)) + [5, 6]]
    requests = [decode.add_request(f"r{i}", p, PARAMS, remote_prefill=True) for i, p in enumerate(prompts)]
    assert decode.step().reserved == requests
    r0, r1, r2 = requests
    assert r1.waits_for == {"r0"} and r2.waits_for == {"r0", "r1"} and r2.num_cached_tokens == 40
    assert decode.activate("r2", *prefill_and_ship(prefill, decode, "r2", prompts[2])) == []
    assert decode.activate("r1", *prefill_and_ship(prefill, decode, "r1", prompts[1])) == []
    assert decode.activate("r0", *prefill_and_ship(prefill, decode, "r0", prompts[0])) == [r0, r1, r2]
    run_to_end(decode)
    assert [r.output_token_ids for r in requests] == [hf_greedy(hf, p, 6) for p in prompts]
    assert decode.num_free_blocks == decode.num_total_blocks


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("how", ["transfer_failed", "aborted"])
def test_a_sharer_computes_its_prompt_here_when_the_owner_fails(model: tuple[Path, object], when: str,
                                                                 how: str) -> None:
    """The owner's transfer fails (or it is aborted) before or after the sharer's own pages land: the sharer
    computes its prompt here, never earlier than its own transfer's end, and its tokens are still right."""
    path, hf = model
    prefill, decode = engines(path)
    first, second = two_prompts()
    a = decode.add_request("a", first, PARAMS, remote_prefill=True)
    b = decode.add_request("b", second, PARAMS, remote_prefill=True)
    decode.step()
    assert b.waits_for == {"a"}

    def fail_owner() -> None:
        if how == "aborted":
            decode.abort("a")
        else:
            decode.prefill_locally("a", "transfer_failed")

    if when == "before":
        fail_owner()
        assert b.status is RequestStatus.WAITING_FOR_KV  # its own transfer may still be writing: it stays
        assert decode.activate("b", *prefill_and_ship(prefill, decode, "b", second)) == []
    else:
        assert decode.activate("b", *prefill_and_ship(prefill, decode, "b", second)) == []
        fail_owner()
    assert b.status is RequestStatus.WAITING and b.local_prefill_reason == "shared_prefix_failed"
    assert not decode.scheduler.pending
    run_to_end(decode)
    assert b.output_token_ids == hf_greedy(hf, second, 6)
    assert 0 < b.local_prefill_tokens["shared_prefix_failed"] <= len(second)  # computed here, counted so
    if how == "transfer_failed":
        assert a.output_token_ids == hf_greedy(hf, first, 6)
    assert decode.num_free_blocks == decode.num_total_blocks
    decode.block_pool.check_integrity()


def test_a_doomed_sharer_shares_its_own_blocks_with_nobody_new(model: tuple[Path, object]) -> None:
    """b shares a's blocks and registers its own tail; once a fails, b will fail too: its tail is withdrawn, so a
    later c with b's prefix does not wait for b."""
    path, _ = model
    _, decode = engines(path)
    first, _ = two_prompts()
    tail = first[:40] + prompts_for(400, [16])[0]
    decode.add_request("a", first, PARAMS, remote_prefill=True)
    b = decode.add_request("b", tail + [1, 2], PARAMS, remote_prefill=True)
    decode.step()
    assert b.waits_for == {"a"} and b.pending_hashes
    decode.prefill_locally("a", "transfer_failed")
    assert b.shared_prefix_failed and not b.pending_hashes and not decode.scheduler.pending
    c = decode.add_request("c", tail + [3, 4, 5], PARAMS, remote_prefill=True)
    decode.step()
    assert c.status is RequestStatus.WAITING_FOR_KV and not c.waits_for


@pytest.mark.parametrize("how", ["expired", "withdrawn"])
def test_a_landed_sharer_stops_waiting(model: tuple[Path, object], how: str) -> None:
    """A sharer whose pages are in computes its prompt here when its wait expires, or when the owner's transfer
    is found failing (the owner's writer may still be stopping: the shared blocks stay with the owner)."""
    path, hf = model
    prefill, decode = engines(path)
    first, second = two_prompts()
    a = decode.add_request("a", first, PARAMS, remote_prefill=True)
    b = decode.add_request("b", second, PARAMS, remote_prefill=True)
    decode.step()
    assert decode.activate("b", *prefill_and_ship(prefill, decode, "b", second)) == []
    if how == "expired":
        decode.expire_shared_wait("b")
        reason = "shared_prefix_wait"
    else:
        decode.withdraw("a")
        reason = "shared_prefix_failed"
        assert not decode.scheduler.pending and a.status is RequestStatus.WAITING_FOR_KV
    assert b.status is RequestStatus.WAITING and b.local_prefill_reason == reason
    assert all(decode.block_pool.ref_count(block) == 1 for block in a.block_ids)  # a's own again
    if how == "expired":
        assert decode.activate("a", *prefill_and_ship(prefill, decode, "a", first)) == [a]
    else:
        decode.prefill_locally("a", "transfer_failed")
    run_to_end(decode)
    assert [a.output_token_ids, b.output_token_ids] == [hf_greedy(hf, p, 6) for p in (first, second)]
    assert decode.num_free_blocks == decode.num_total_blocks
    decode.expire_shared_wait("b")  # long gone: nothing happens
    decode.block_pool.check_integrity()


def test_without_the_prefix_cache_nothing_is_shared(model: tuple[Path, object]) -> None:
    path, _ = model
    config = EngineConfig.create(load_model_config(str(path)), max_model_len=128, block_size=BLOCK,
                                 enable_prefix_caching=False)
    decode = Engine(config)
    first, second = two_prompts()
    decode.add_request("a", first, PARAMS, remote_prefill=True)
    b = decode.add_request("b", second, PARAMS, remote_prefill=True)
    decode.step()
    assert b.num_cached_tokens == 0 and not b.waits_for and not decode.scheduler.pending


# -- the scheduler alone, any order of events ---------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 40))
def test_any_order_of_landings_failures_and_aborts_keeps_the_pool_whole(seed: int, num_blocks: int) -> None:
    """Remote requests over a few shared prefixes, their pages landing, failing or aborted in any order: nobody
    activates before the requests whose blocks it shares, every request that is not aborted runs to its end, and
    the pool is whole afterwards."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, enable_chunked_prefill=True)
    scheduler = Scheduler(config, BlockPool(num_blocks), 4, (2,), prefix_key=b"test")
    prefixes = [[10 + i for i in range(n)] for n in (8, 12, 5)]
    live: list[Request] = []
    landed_order: list[str] = []

    def land(request: Request) -> None:
        """What `Engine.activate` does with the scheduler."""
        if request.shared_prefix_failed:
            scheduler.prefill_locally(request, "shared_prefix_failed")
            return
        if request.waits_for:
            request.landed = (5, 0.0)
            return
        ready = [request]
        while ready:
            r = ready.pop()
            assert not r.waits_for
            scheduler.activate(r)
            landed_order.append(r.req_id)
            scheduler.append_token(r, 5, 0.0)
            ready += scheduler.released_by(r)

    for step in range(80):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 9) for _ in range(rng.randint(1, 6))]
            request = Request(req_id=f"r{step}", prompt_token_ids=prompt,
                              params=SamplingParams(max_tokens=rng.randint(1, 4)), seed=0, remote_prefill=True)
            scheduler.add(request)
            live.append(request)
        receiving = [r for r in scheduler.receiving.values() if r.landed is None]
        if receiving and rng.random() < 0.5:
            request = rng.choice(receiving)
            event = rng.random()
            if event < 0.65:
                land(request)
            elif event < 0.75:
                scheduler.prefill_locally(request, "transfer_failed")
            elif event < 0.85:  # failing: withdrawn at once, computed here once its writer has stopped
                scheduler.withdraw(request)
                assert not any(owner == request.req_id for _, owner in scheduler.pending.values())
                scheduler.prefill_locally(request, "transfer_failed")
            else:
                scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        waiting = [r for r in scheduler.receiving.values() if r.landed is not None]
        if waiting and rng.random() < 0.1:  # a wait that expired
            scheduler.prefill_locally(rng.choice(waiting), "shared_prefix_wait")
        output = scheduler.schedule()
        if output is not None:
            num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
            scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
        for r in scheduler.receiving.values():
            for owner in r.waits_for:  # whoever it waits for is still on its way, or failed it
                assert owner in scheduler.receiving or r.shared_prefix_failed, (r.req_id, owner)
    for _ in range(500):  # everything still in flight lands, in any order
        receiving = [r for r in scheduler.receiving.values() if r.landed is None]
        if receiving:
            land(rng.choice(receiving))
        output = scheduler.schedule()
        if output is not None:
            num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
            scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
        elif not receiving and not scheduler.has_unfinished() and not scheduler.receiving:
            break
    assert not scheduler.receiving and not scheduler.pending
    assert all(r.status.is_finished for r in live)
    scheduler.block_pool.check_integrity()
    assert scheduler.block_pool.num_free_blocks == num_blocks

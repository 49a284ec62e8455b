"""Scheduler and block pool on the CPU with fake model outputs (no model, no tensors)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.config import SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.engine.step_plan import num_blocks_for

EOS = 2
BLOCK = 4


def make_request(req_id: str, prompt_len: int, max_tokens: int = 8, **kw: object) -> Request:
    return Request(req_id=req_id, prompt_token_ids=[10 + i for i in range(prompt_len)],
                   params=SamplingParams(max_tokens=max_tokens, **kw), seed=0)  # type: ignore[arg-type]


def make_scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64, chunked: bool = False,
                   prompt_cap: int = 0) -> Scheduler:
    """Whole-prompt steps unless `chunked` (the tests of chunked prefill are below)."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             prompt_tokens_while_decoding=prompt_cap)
    return Scheduler(config, BlockPool(num_blocks), BLOCK, (EOS,))


def run_step(scheduler: Scheduler, token: int = 5) -> list[Request]:
    output = scheduler.schedule()
    assert output is not None
    num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
    return scheduler.update_from_output(output, [token] * num_sampling, [0.0] * num_sampling)


def test_block_pool_allocates_frees_and_detects_double_free() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert pool.num_free_blocks == 1 and not pool.can_allocate(2)
    pool.free(ids)
    pool.check_integrity()
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(ids[:1])


def test_prefill_first_fcfs_with_token_budget() -> None:
    scheduler = make_scheduler(num_blocks=64, budget=10)
    for i, n in enumerate([6, 6, 3]):
        scheduler.add(make_request(f"r{i}", n))
    output = scheduler.schedule()
    assert output is not None and output.is_prefill
    # r1 does not fit the budget, and r2 must not overtake it.
    assert [r.req_id for r in output.requests] == ["r0"]


def test_finished_request_frees_blocks_and_waiting_one_joins_at_once() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots
    a, b = make_request("a", 7, max_tokens=2), make_request("b", 7, max_tokens=2)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # prefill a and b: 2 blocks each, pool full
    assert scheduler.block_pool.num_free_blocks == 0
    c = make_request("c", 7, max_tokens=2)
    scheduler.add(c)
    finished = run_step(scheduler)  # decode: a and b reach max_tokens
    assert {r.req_id for r in finished} == {"a", "b"}
    output = scheduler.schedule()
    assert output is not None and output.is_prefill and output.requests == [c]


def test_eos_stops_unless_ignore_eos() -> None:
    scheduler = make_scheduler(num_blocks=16)
    stops, runs_on = make_request("s", 3), make_request("i", 3, ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(runs_on)
    run_step(scheduler, token=EOS)
    assert stops.status is RequestStatus.FINISHED_STOPPED
    assert runs_on.status is RequestStatus.RUNNING and runs_on.output_token_ids == [EOS]


def test_stop_token_ids_and_max_tokens() -> None:
    scheduler = make_scheduler(num_blocks=16)
    r = make_request("r", 3, max_tokens=3, stop_token_ids=[7])
    scheduler.add(r)
    run_step(scheduler, token=5)
    run_step(scheduler, token=7)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 7]
    q = make_request("q", 3, max_tokens=2)
    scheduler.add(q)
    run_step(scheduler)
    run_step(scheduler)
    assert q.finish_reason == "length" and len(q.output_token_ids) == 2


def test_preemption_by_recompute_when_pool_runs_out() -> None:
    scheduler = make_scheduler(num_blocks=3)
    old, new = make_request("old", 4, max_tokens=6), make_request("new", 4, max_tokens=6)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled: 1 block each (4 tokens), 1 free
    run_step(scheduler)  # 5 tokens each: old takes the last block, new is preempted
    assert new.status is RequestStatus.WAITING and new.num_preemptions == 1
    assert new.block_ids == [] and scheduler.waiting[0] is new
    assert old.status is RequestStatus.RUNNING
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert old.num_output_tokens == 6 and new.num_output_tokens == 6
    scheduler.block_pool.check_integrity()
    assert scheduler.block_pool.num_free_blocks == 3


def test_finish_frees_blocks_in_every_state() -> None:
    scheduler = make_scheduler(num_blocks=16)
    waiting, running = make_request("w", 3), make_request("r", 3)
    scheduler.add(running)
    run_step(scheduler)
    scheduler.add(waiting)
    receiving = make_request("k", 5)
    receiving.remote_prefill = True
    scheduler.add(receiving)
    assert scheduler.schedule().reserved == [receiving]  # type: ignore[union-attr]
    prefilled = make_request("p", 3)
    prefilled.prefill_only = True
    scheduler.add(prefilled)
    run_step(scheduler)  # prefills w and p; p is held for export
    assert prefilled.status is RequestStatus.PREFILLED
    for r in (waiting, running, receiving, prefilled):
        scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
        scheduler.finish(r, RequestStatus.FINISHED_ABORTED)  # idempotent
    scheduler.block_pool.check_integrity()
    assert scheduler.block_pool.num_free_blocks == 16
    assert not scheduler.has_unfinished() and not scheduler.receiving and not scheduler.prefilled


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(6, 24), chunked=st.booleans(),
       budget=st.integers(1, 64), prompt_cap=st.integers(0, 12),
       step_sizes=st.sampled_from([(), (4, 8, 16), (3, 5, 12, 32)]))
def test_random_mix_always_returns_every_block(seed: int, num_blocks: int, chunked: bool, budget: int,
                                               prompt_cap: int, step_sizes: tuple[int, ...]) -> None:
    """Any mix of finishing, EOS-stopped, aborted and preempted requests, with prompts in chunks or whole (and
    prompt tokens capped beside decodes, chunks trimmed to step sizes), leaves the pool whole, and every request
    that is not aborted finishes."""
    rng = random.Random(seed)
    budget = budget if chunked else 64  # whole prompts need a budget that holds one
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=budget, chunked=chunked,
                               prompt_cap=prompt_cap)
    scheduler.step_sizes = step_sizes
    live: list[Request] = []
    for step in range(60):
        if rng.random() < 0.4:
            r = make_request(f"r{step}", rng.randint(1, 8), max_tokens=rng.randint(1, 10))
            scheduler.add(r)
            live.append(r)
        if live and rng.random() < 0.1:
            scheduler.finish(live.pop(rng.randrange(len(live))), RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        if output is not None:
            assert output.num_tokens <= budget
            num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
            tokens = [EOS if rng.random() < 0.05 else 5 for _ in range(num_sampling)]
            scheduler.update_from_output(output, tokens, [0.0] * len(tokens))
        for r in scheduler.running:
            assert len(r.block_ids) >= num_blocks_for(r.num_computed_tokens, BLOCK)
            assert r.num_computed_tokens <= r.num_tokens
        live = [r for r in live if not r.status.is_finished]
    for _ in range(2000):  # no new arrivals: everything admitted runs to its end
        output = scheduler.schedule()
        if output is None:
            break
        num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
        scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
    assert all(r.status.is_finished for r in live), [r.status for r in live]
    scheduler.block_pool.check_integrity()
    assert scheduler.block_pool.num_free_blocks == num_blocks


# -- chunked prefill ---------------------------------------------------------------------------------------
def test_long_prompt_is_computed_in_chunks_next_to_running_decodes() -> None:
    scheduler = make_scheduler(num_blocks=64, budget=8, chunked=True)
    running = make_request("d", 3, max_tokens=20)
    scheduler.add(running)
    run_step(scheduler)  # d prefilled (3 tokens) and sampled its first token
    long = make_request("p", 19, max_tokens=2)
    scheduler.add(long)
    seen = []
    for _ in range(3):
        output = scheduler.schedule()
        assert output is not None
        seen.append(list(zip([r.req_id for r in output.requests], output.num_new_tokens, strict=True)))
        num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
        scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
    # Decode tokens first, then the prompt in chunks of what is left of the budget (8 - 1); its last chunk
    # samples its first token.
    assert seen == [[("d", 1), ("p", 7)], [("d", 1), ("p", 7)], [("d", 1), ("p", 5)]]
    assert long.num_output_tokens == 1 and running.num_output_tokens == 4
    assert long.num_computed_tokens == 19


def test_prompt_tokens_beside_decodes_are_capped_until_the_queue_builds() -> None:
    scheduler = make_scheduler(num_blocks=256, budget=64, chunked=True, prompt_cap=8, max_num_seqs=16)
    decoding = make_request("d", 3, max_tokens=100)
    scheduler.add(decoding)
    run_step(scheduler)  # alone: its whole prompt (no one decodes yet)
    scheduler.add(make_request("p", 20, max_tokens=2))
    output = scheduler.schedule()
    assert output is not None
    # One decode token, then at most 8 prompt tokens: the queue (20 tokens) is short.
    assert list(zip([r.req_id for r in output.requests], output.num_new_tokens, strict=True)) == [("d", 1), ("p", 8)]
    scheduler.update_from_output(output, [5], [0.0])
    # 8 x 8 = 64 tokens clear the queue in "capped" steps; with 12 + 70 waiting the whole budget is used.
    scheduler.add(make_request("q", 70, max_tokens=2))
    output = scheduler.schedule()
    assert output is not None
    assert output.num_new_tokens[0] == 1 and sum(output.num_new_tokens) == 64
    # Nobody decoding: no cap either.
    idle = make_scheduler(num_blocks=256, budget=64, chunked=True, prompt_cap=8)
    idle.add(make_request("a", 30, max_tokens=2))
    first = idle.schedule()
    assert first is not None and first.num_new_tokens == [30]


def test_a_prompt_that_waited_lifts_the_cap_to_the_lifted_size() -> None:
    """The cap experiments: past `cap_max_wait_s` since the oldest prompt's arrival the cap is lifted, to `cap_lift`
    prompt tokens when set (else to the whole budget)."""
    scheduler = make_scheduler(num_blocks=256, budget=64, chunked=True, prompt_cap=8, max_num_seqs=16)
    now = 100.0
    scheduler.clock = lambda: now
    scheduler.cap_max_wait_s = 0.05
    scheduler.cap_lift = 24
    decoding = make_request("d", 3, max_tokens=100)
    scheduler.add(decoding)
    run_step(scheduler)
    waiting = make_request("p", 60, max_tokens=2)
    waiting.arrival_time = now
    scheduler.add(waiting)
    assert step_tokens(scheduler) == [("d", 1), ("p", 8)]  # a short queue, a fresh prompt: capped
    now += 0.06
    assert step_tokens(scheduler) == [("d", 1), ("p", 24)]  # waited 60 ms: lifted to 24, not to 63
    scheduler.cap_lift = 4
    assert step_tokens(scheduler) == [("d", 1), ("p", 8)]  # a lift below the cap never shrinks it
    scheduler.cap_lift = 0
    assert step_tokens(scheduler) == [("d", 1), ("p", 60 - 40)]  # the whole budget (what is left of the prompt)


def test_the_cap_experiments_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.common.config import ConfigError
    from tandem.common.config import env_number as _env_number
    from tandem.engine.engine import CAP_LIFT_ENV, CAP_MAX_WAIT_ENV

    monkeypatch.setenv(CAP_MAX_WAIT_ENV, "50")
    assert _env_number(CAP_MAX_WAIT_ENV, 0.0) == 50.0
    monkeypatch.setenv(CAP_LIFT_ENV, "many")
    with pytest.raises(ConfigError, match=CAP_LIFT_ENV):
        _env_number(CAP_LIFT_ENV, 0)
    for bad in ("-1", "inf", "nan"):
        monkeypatch.setenv(CAP_MAX_WAIT_ENV, bad)
        with pytest.raises(ConfigError, match=CAP_MAX_WAIT_ENV):
            _env_number(CAP_MAX_WAIT_ENV, 0.0)
    monkeypatch.setenv(CAP_LIFT_ENV, "0.5")
    with pytest.raises(ConfigError, match="an integer"):
        _env_number(CAP_LIFT_ENV, 0, int)


def step_tokens(scheduler: Scheduler) -> list[tuple[str, int]]:
    output = scheduler.schedule()
    assert output is not None
    num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
    scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
    return list(zip([r.req_id for r in output.requests], output.num_new_tokens, strict=True))


@pytest.mark.parametrize(("budget", "chunks"), [
    (36, [31, 31, 31, 7]),  # 1 + 35 would pad to 48 (12 rows): 4 tokens trimmed, each step ends on 32
    (44, [43, 43, 14]),  # padding 4 rows beats trimming 12 tokens
    (40, [39, 39, 22]),  # a tie keeps the tokens
    (64, [63, 37]),  # exact
])
def test_a_continuing_chunk_is_trimmed_to_a_step_size_when_that_beats_padding(budget: int, chunks: list[int]) -> None:
    scheduler = make_scheduler(num_blocks=256, budget=budget, chunked=True)
    scheduler.step_sizes = (16, 32, 48, 64)
    scheduler.add(make_request("d", 3, max_tokens=100))
    step_tokens(scheduler)
    scheduler.add(make_request("p", 100, max_tokens=2))
    seen = [step_tokens(scheduler) for _ in chunks]
    assert [step[1] for step in seen] == [("p", n) for n in chunks]  # after d's decode token, every step
    # The prompt's last chunk is never trimmed (that would cost it a step): it sampled its first token.
    assert scheduler.running[-1].req_id == "p" and scheduler.running[-1].num_output_tokens == 1


def test_budget_below_the_running_count_runs_as_many_decodes_as_fit() -> None:
    scheduler = make_scheduler(num_blocks=64, budget=2, chunked=True, max_num_seqs=4)
    requests = [make_request(f"r{i}", 1, max_tokens=3) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        assert output is not None and output.num_tokens <= 2
        num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
        scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
    assert all(r.finish_reason == "length" for r in requests)
    scheduler.block_pool.check_integrity()


def test_preemption_mid_prompt_recomputes_from_the_start() -> None:
    scheduler = make_scheduler(num_blocks=4, budget=4, chunked=True)
    old = make_request("old", 8, max_tokens=8)  # needs 4 blocks by its end
    scheduler.add(old)
    run_step(scheduler)  # old: 4 of 8 prompt tokens
    new = make_request("new", 8, max_tokens=2)
    scheduler.add(new)
    while old.status is not RequestStatus.FINISHED_LENGTH:
        run_step(scheduler)
    while scheduler.has_unfinished():
        run_step(scheduler)
    # new was preempted part-way through its prompt (old, older, kept growing), then computed again from 0.
    assert new.num_preemptions >= 1
    assert new.finish_reason == "length" and old.finish_reason == "length"
    assert new.local_prefill_tokens.get("preemption", 0) >= 8 and new.local_prefill_tokens.get("local", 0) > 0
    scheduler.block_pool.check_integrity()
    assert scheduler.block_pool.num_free_blocks == 4


def test_chunks_shrink_past_a_long_context() -> None:
    """A prompt chunk takes the whole budget up to LONG_CONTEXT_TOKENS of context, then a share that falls with the
    context (its attention grows with it), so a step shared with decode tokens stays about as long; every prompt
    token is still computed exactly once."""
    from tandem.engine.step_plan import LONG_CONTEXT_TOKENS, chunk_limit

    assert chunk_limit(2048, 0) == chunk_limit(2048, LONG_CONTEXT_TOKENS) == 2048
    assert chunk_limit(2048, 2 * LONG_CONTEXT_TOKENS) == 1024 and chunk_limit(2048, 4 * LONG_CONTEXT_TOKENS) == 512
    assert chunk_limit(1, 10 * LONG_CONTEXT_TOKENS) == 1
    prompt_len = 3 * LONG_CONTEXT_TOKENS + 100
    scheduler = make_scheduler(num_blocks=num_blocks_for(prompt_len + 8, BLOCK) + 4, budget=4096, chunked=True)
    request = make_request("long", prompt_len, max_tokens=2)
    scheduler.add(request)
    chunks = []
    while request.num_output_tokens == 0:
        context = request.num_computed_tokens
        output = scheduler.schedule()
        assert output is not None
        chunks.append((context, output.num_new_tokens[0]))
        num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
        scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
    assert all(n == min(chunk_limit(4096, context), prompt_len - context) for context, n in chunks)
    assert sum(n for _, n in chunks) == prompt_len and chunks[1] == (4096, 4096) and chunks[-1][1] < 4096


def remote(req_id: str, prompt_len: int) -> Request:
    request = make_request(req_id, prompt_len)
    request.remote_prefill = True
    return request


def test_remote_prefill_requests_are_reserved_between_steps_in_order() -> None:
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=4)
    scheduler.add(make_request("local", 4, max_tokens=20))
    run_step(scheduler)  # running, holding 1 block (2 once its next token starts a new one)
    for request in (remote("a", 8), remote("b", 8), make_request("c", 4), remote("d", 4)):
        scheduler.add(request)
    reserved = scheduler.reserve_waiting()
    # a and b (2 blocks each), at once; the local c stops it (first come, first served), so d waits behind it.
    assert [r.req_id for r in reserved] == ["a", "b"]
    assert all(r.status is RequestStatus.WAITING_FOR_KV and len(r.block_ids) == 2 for r in reserved)
    assert [r.req_id for r in scheduler.waiting] == ["c", "d"]
    assert scheduler.reserve_waiting() == []
    # The next step admits c (the batch is then full: 1 running + 2 receiving + c) and reserves nobody twice.
    output = scheduler.schedule()
    assert output is not None and output.reserved == [] and [r.req_id for r in output.requests] == ["local", "c"]
    scheduler.block_pool.check_integrity()


def test_a_reservation_between_steps_leaves_a_block_per_running_request() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=8)
    for i in range(2):
        scheduler.add(make_request(f"run{i}", 4, max_tokens=20))
    run_step(scheduler)  # two running requests, a block each: 4 free
    scheduler.add(remote("big", 13))  # 4 blocks: it would leave nothing for the running requests to grow into
    assert scheduler.reserve_waiting() == []
    scheduler.add(remote("later", 4))
    assert scheduler.reserve_waiting() == []  # behind the head, whatever its size
    # The step grows the running requests first, then admission reserves what fits (as before).
    output = scheduler.schedule()
    assert output is not None and output.preempted == [] and output.reserved == []
    scheduler.block_pool.check_integrity()


def test_a_prompt_cached_but_for_its_last_block_is_left_to_the_step() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, BlockPool(32), BLOCK, (EOS,), prefix_key=b"model")
    scheduler.add(make_request("first", 9, max_tokens=1))
    run_step(scheduler)  # its two full blocks are now cached
    scheduler.add(remote("again", 9))
    assert scheduler.reserve_waiting() == []
    output = scheduler.schedule()
    assert output is not None and [r.req_id for r in output.requests] == ["again"]
    assert output.requests[0].local_prefill_reason == "prefix_cached"

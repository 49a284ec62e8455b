"""Async scheduling: consecutive pure decode steps launched one ahead of the host (`Engine._launch_next`) give the
same tokens as steps run one at a time, greedy and seeded, with stop tokens, length limits, a short pool, requests
joining and aborts while a step is in flight; every block comes back, and a block a step in flight writes is never
handed out before the step is read. On the CPU a launch runs to its end, so these check the bookkeeping; the GPU
suite measures the overlap."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.engine.engine import Engine
from tests.factories import hf_greedy, prompts_for, save_random_hf_model

VOCAB = 512


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_ASYNC_SCHEDULING", raising=False)  # the tests choose on or off themselves


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("async-model")
    return path, save_random_hf_model(path)


def llm(path: Path, async_scheduling: bool, **kwargs: object) -> LLM:
    return LLM(str(path), max_model_len=128, block_size=4, async_scheduling=async_scheduling, **kwargs)


def count_lookaheads(engine: Engine) -> list[int]:
    """Counts the steps `engine` launches ahead of the host (so a test can tell the path was taken)."""
    launched = [0]
    launch_next = engine._launch_next

    def counting(current):  # type: ignore[no-untyped-def]
        step = launch_next(current)
        launched[0] += step is not None
        return step

    engine._launch_next = counting  # type: ignore[method-assign]
    return launched


def test_greedy_tokens_equal_steps_one_at_a_time_and_hf(model_dir) -> None:
    path, hf = model_dir
    prompts = prompts_for(VOCAB, [5, 17, 9, 30, 3, 12])
    params = [SamplingParams(max_tokens=4 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    on = llm(path, True)
    assert on.engine.async_scheduling
    launched = count_lookaheads(on.engine)
    got = [o.token_ids for o in on.generate(prompts, params)]
    assert launched[0] > 10
    off = llm(path, False)
    assert not off.engine.async_scheduling
    assert got == [o.token_ids for o in off.generate(prompts, params)]
    assert got == [hf_greedy(hf, p, s.max_tokens) for p, s in zip(prompts, params, strict=True)]
    assert on.engine.num_free_blocks == on.engine.num_total_blocks and not on.engine.has_unfinished()
    on.engine.block_pool.check_integrity()


def test_seeded_sampling_and_stop_tokens_equal_steps_one_at_a_time(model_dir) -> None:
    """A draw's position counts the token not yet applied; a stop token ends a request whose next token was already
    launched, and that token never shows."""
    path, _ = model_dir
    prompts = prompts_for(VOCAB, [6, 11, 4, 20])
    reference = llm(path, False).generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    # Stop on a token each greedy run emits midway: those requests end early, the others run on beside them.
    stops = [o.token_ids[8] for o in reference[:2]]
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=11 + i, ignore_eos=True) for i in range(4)]
    params += [SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=stops, ignore_eos=True)] * 4
    prompts = prompts + prompts
    on, off = llm(path, True), llm(path, False)
    launched = count_lookaheads(on.engine)
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 24 for o in got[4:])
    assert launched[0] > 0
    assert on.engine.num_free_blocks == on.engine.num_total_blocks


def test_short_pool_and_a_queue_fall_back_and_give_the_same_tokens(model_dir) -> None:
    """More requests than sequences, a pool that preempts: a step is launched ahead only when nobody waits and
    every running request has room; the tokens are the same."""
    path, _ = model_dir
    prompts = prompts_for(VOCAB, [9, 14, 3, 22, 7, 16, 5, 11])
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kwargs = dict(max_num_seqs=3, num_kv_blocks=40, max_num_batched_tokens=16)
    on = llm(path, True, **kwargs)
    launched = count_lookaheads(on.engine)
    got = [o.token_ids for o in on.generate(prompts, params)]
    assert got == [o.token_ids for o in llm(path, False, **kwargs).generate(prompts, params)]
    assert launched[0] > 0
    assert on.engine.num_free_blocks == on.engine.num_total_blocks
    on.engine.block_pool.check_integrity()


def test_a_block_written_by_a_step_in_flight_is_not_handed_out_until_it_is_read(model_dir) -> None:
    path, _ = model_dir
    engine = llm(path, True).engine
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts_for(VOCAB, [4, 7])):  # 4 tokens: the next step starts a new block
        engine.add_request(f"r{i}", prompt, greedy)
    while engine._in_flight is None:
        engine.step()
    in_flight = engine._in_flight
    pinned = list(in_flight.pinned)
    assert len(pinned) == 2
    engine.abort("r0")
    engine.abort("r1")
    # Both requests ended and freed their blocks, but the launched step may still write one slot of each.
    assert all(engine.block_pool.ref_count(b) == 1 for b in pinned)
    assert engine.has_unfinished()
    result = engine.step()
    assert result.requests == [] and engine._in_flight is None and not engine.has_unfinished()
    assert all(engine.block_pool.ref_count(b) == 0 for b in pinned)
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.block_pool.check_integrity()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(events=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]), st.integers(0, 7),
                                 st.integers(1, 12)), max_size=40))
def test_any_order_of_arrivals_aborts_and_steps(model_dir, events) -> None:
    """Requests arrive and are aborted between steps, whether a step is in flight or not: each request that is not
    aborted ends with the tokens it gets alone, and every block comes back."""
    path, hf = model_dir
    engine = llm(path, True, max_num_seqs=4, num_kv_blocks=48).engine
    prompts = prompts_for(VOCAB, [3, 8, 5, 13, 4, 9, 6, 2])
    added: dict[str, tuple[int, int]] = {}
    aborted: set[str] = set()
    for kind, index, max_tokens in events:
        req_id = f"r{index}"
        if kind == "add" and req_id not in added:
            added[req_id] = (index, max_tokens)
            engine.add_request(req_id, prompts[index], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True))
        elif kind == "abort" and req_id in engine.requests:
            engine.abort(req_id)
            aborted.add(req_id)
        elif kind == "step" and engine.has_unfinished():
            engine.step()
    requests = {req_id: engine.requests[req_id] for req_id in added if req_id in engine.requests}
    while engine.has_unfinished():
        engine.step()
    for req_id, request in requests.items():
        index, max_tokens = added[req_id]
        assert request.output_token_ids == hf_greedy(hf, prompts[index], max_tokens), req_id
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.block_pool.check_integrity()


def test_the_variable_turns_it_on_for_served_workers(model_dir, monkeypatch) -> None:
    from tandem.common.config import ConfigError

    path, _ = model_dir
    monkeypatch.setenv("TANDEM_ASYNC_SCHEDULING", "1")
    assert llm(path, False).engine.async_scheduling
    monkeypatch.setenv("TANDEM_ASYNC_SCHEDULING", "0")
    assert not llm(path, True).engine.async_scheduling
    monkeypatch.setenv("TANDEM_ASYNC_SCHEDULING", "yes")
    with pytest.raises(ConfigError, match="TANDEM_ASYNC_SCHEDULING"):
        llm(path, True)


def test_a_reservation_made_by_a_launched_step_is_reported(model_dir) -> None:
    """A pool too full for the between-steps reservation (it keeps a block free per running request) leaves a
    remote-prefill request to the next step's admission; when that step is a pure decode step launched ahead, the
    reservation must still reach the caller, which starts the transfer (lost, the request waited for its pages
    forever: the H200's 8B stack row with async scheduling, reproduced on the CPU stack)."""
    path, _ = model_dir
    engine = LLM(str(path), max_model_len=40, block_size=4, num_kv_blocks=11, async_scheduling=True,
                 enable_prefix_caching=False).engine
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts_for(VOCAB, [14, 14])):  # 4 blocks each
        engine.add_request(f"r{i}", prompt, greedy)
    engine.step()  # their prompts: 3 blocks left free
    engine.add_request("remote", prompts_for(VOCAB, [8])[0], greedy, remote_prefill=True)  # 2 blocks
    assert engine.reserve_waiting() == []  # 2 + a block per running request do not fit between steps
    launches = [0]
    launch_decode = engine.runner.launch_decode

    def counting(*args):  # type: ignore[no-untyped-def]
        launches[0] += 1
        return launch_decode(*args)

    engine.runner.launch_decode = counting  # type: ignore[method-assign]
    result = engine.step()  # decodes r0 and r1 (launched ahead) and admits the remote request beside them
    assert engine.requests["remote"].block_ids and launches[0] >= 1
    assert [r.req_id for r in result.reserved] == ["remote"]

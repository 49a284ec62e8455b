"""Prefill pipelining (prefill role, with async scheduling): a step of prompt chunks is launched and the next one
scheduled and launched before the first's tokens are read. The first tokens and the pages equal those of steps run
one at a time, with prompts arriving between steps, chunked prompts, prefix hits on blocks a step in flight writes,
preemption and aborts; every block comes back. On the CPU a launch runs to its end, so these check the bookkeeping;
the GPU suite measures the overlap."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import SamplingParams
from tandem.common.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import RequestStatus
from tandem.models import load_model_config
from tests.factories import prompts_for, save_random_hf_model

VOCAB = 512
BLOCK = 4
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_ASYNC_SCHEDULING", raising=False)
    monkeypatch.delenv("TANDEM_PREFILL_PIPELINE", raising=False)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipeline-model")
    save_random_hf_model(path)
    return path


def engine(path: Path, pipelined: bool, budget: int = 64, num_blocks: int | None = None) -> Engine:
    config = EngineConfig.create(load_model_config(str(path)), max_model_len=128, block_size=BLOCK,
                                 max_num_batched_tokens=budget, num_kv_blocks=num_blocks, async_scheduling=pipelined)
    result = Engine(config)
    assert result.pipeline_prefill == pipelined
    return result


def count_lookaheads(engine: Engine) -> list[int]:
    """Counts the steps launched while another was in flight (so a test can tell the path was taken)."""
    launched = [0]
    launch = engine._launch_prefill

    def counting(output):  # type: ignore[no-untyped-def]
        launched[0] += engine._prefill_reading is not None
        return launch(output)

    engine._launch_prefill = counting  # type: ignore[method-assign]
    return launched


def serve(engine: Engine, waves: list[list[tuple[str, list[int]]]], abort: set[str] = frozenset()
          ) -> dict[str, tuple[int, float, list[torch.Tensor]]]:
    """Add each wave before a step (the waves after the first arrive while a step is in flight), abort `abort` right
    after their first step, release each prompt once it has its first token; its first token, logprob and pages."""
    out: dict[str, tuple[int, float, list[torch.Tensor]]] = {}
    waves = list(waves)
    seen_running: set[str] = set()
    while waves or engine.has_unfinished():
        if waves:
            for req_id, prompt in waves.pop(0):
                engine.add_request(req_id, prompt, PARAMS, prefill_only=True)
        result = engine.step()
        for request in result.requests:
            if request.req_id in abort and request.req_id not in seen_running:
                seen_running.add(request.req_id)
                engine.abort(request.req_id)
            elif request.status is RequestStatus.PREFILLED and request.output_token_ids:
                pages = [torch.cat(engine.read_pages(request, layer)) for layer in range(engine.layout.num_layers)]
                out[request.req_id] = (request.output_token_ids[0], request.output_logprobs[0], pages)
                engine.release(request.req_id)
    return out


def check_all_back(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine.requests
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.block_pool.check_integrity()


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for req_id, (token, logprob, pages) in want.items():
        assert got[req_id][0] == token, req_id
        assert got[req_id][1] == pytest.approx(logprob, abs=1e-5), req_id
        for a, b in zip(got[req_id][2], pages, strict=True):
            torch.testing.assert_close(a, b)


def test_first_tokens_and_pages_equal_steps_one_at_a_time(model_path: Path) -> None:
    """Waves of prompts, some longer than the step's budget (chunked over steps), some sharing a prefix with a prompt
    whose blocks a step in flight is still writing."""
    rng = random.Random(3)
    shared = [rng.randrange(2, VOCAB) for _ in range(24)]
    waves = []
    for w in range(5):
        wave = []
        for i, length in enumerate((7, 40, 90, 13)):
            prompt = prompts_for(VOCAB, [length])[0] if i else shared + [w + 2, i + 3]
            prompt = [(t + 31 * w) % VOCAB if i else t for t in prompt]
            wave.append((f"w{w}-{i}", prompt))
        waves.append(wave)
    on, off = engine(model_path, True), engine(model_path, False)
    launched = count_lookaheads(on)
    got, want = serve(on, waves), serve(off, waves)
    assert launched[0] >= 4
    assert_same(got, want)
    check_all_back(on)


def test_an_abort_in_flight_takes_no_token_and_returns_its_blocks(model_path: Path) -> None:
    waves = [[(f"a{i}", p) for i, p in enumerate(prompts_for(VOCAB, [70, 9, 50, 33]))],
             [(f"b{i}", p) for i, p in enumerate(prompts_for(VOCAB, [12, 80, 5]))]]
    aborted = {"a0", "a2", "b1"}
    on, off = engine(model_path, True, budget=32), engine(model_path, False, budget=32)
    got = serve(on, waves, abort=aborted)
    want = serve(off, waves, abort=aborted)
    assert not aborted & got.keys()
    assert_same(got, want)
    check_all_back(on)


def test_a_short_pool_preempts_a_chunked_prompt_and_it_still_completes(model_path: Path) -> None:
    """Fewer blocks than the prompts need at once: a prompt chunked over steps is preempted (its blocks taken back
    while a step in flight computes it) and recomputed; its first token and pages are still right."""
    waves = [[(f"p{i}", p) for i, p in enumerate(prompts_for(VOCAB, [100, 90, 60]))]]
    on = engine(model_path, True, budget=64, num_blocks=36)
    preempt = on.scheduler._preempt
    preempted = []

    def counting(request):  # type: ignore[no-untyped-def]
        preempted.append(request.req_id)
        return preempt(request)

    on.scheduler._preempt = counting  # type: ignore[method-assign]
    got = serve(on, waves)
    assert preempted
    want = serve(engine(model_path, False, budget=64, num_blocks=36), waves)
    assert_same(got, want)
    check_all_back(on)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_aborts_and_budgets(model_path: Path, data: st.DataObject) -> None:
    budget = data.draw(st.sampled_from([8, 16, 48]))
    num_waves = data.draw(st.integers(1, 4))
    waves = [[(f"r{w}-{i}", prompts_for(VOCAB, [data.draw(st.integers(1, 100))])[0])
              for i in range(data.draw(st.integers(0, 3)))] for w in range(num_waves)]
    names = [req_id for wave in waves for req_id, _ in wave]
    aborted = set(data.draw(st.lists(st.sampled_from(names), unique=True)) if names else [])
    on = engine(model_path, True, budget=budget, num_blocks=64)
    got = serve(on, waves, abort=aborted)
    check_all_back(on)
    assert got.keys() == set(names) - aborted
    assert_same(got, serve(engine(model_path, False, budget=budget, num_blocks=64), waves, abort=aborted))


def test_a_failed_launch_with_a_step_in_flight_gives_every_block_back_after_the_aborts(model_path: Path) -> None:
    """The second launch fails while the first step is in flight: the step raises, the caller aborts every request
    (as `AsyncEngine._fail_all` does), and every block comes back."""
    e = engine(model_path, True, budget=16)
    for i, prompt in enumerate(prompts_for(VOCAB, [10, 30, 30])):
        e.add_request(f"r{i}", prompt, PARAMS, prefill_only=True)
    launch = e.runner.launch_chunks
    calls = [0]

    def failing_second(output, hook=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("launch failed")
        return launch(output, hook)

    e.runner.launch_chunks = failing_second  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="launch failed"):
        e.step()
    assert calls[0] == 2 and not e.step_in_flight
    for req_id in list(e.requests):
        e.abort(req_id)
    check_all_back(e)


async def test_the_serving_loop_reads_a_launched_step_at_once_after_an_empty_result(model_path: Path) -> None:
    """Every member of the step read was aborted while the next step was launched: the step's result is empty, and
    the serving loop must read the launched one at once rather than idle as if nothing could run (it waited 50 ms)."""
    import asyncio
    import time

    from tandem.serving.async_engine import AsyncEngine

    e = engine(model_path, True, budget=16)
    steps: list[tuple[float, float, list[str]]] = []
    step = e.step

    def recording_step():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = step()
        steps.append((start, time.perf_counter(), [r.req_id for r in result.requests]))
        if len(steps) == 1:  # r0 read with r1's step launched behind it: release r0, abort r1 (only it is in flight)
            assert e._prefill_in_flight is not None
            assert [r.req_id for r in e._prefill_in_flight.output.requests] == ["r1"]
            for request in result.requests:
                e.release(request.req_id)
            e.abort("r1")
        elif not e.step_in_flight:
            for req_id in list(e.requests):
                e.release(req_id)
        return result

    e.step = recording_step  # type: ignore[method-assign]
    served = AsyncEngine(e)
    try:
        def add(core: Engine) -> None:
            for i, prompt in enumerate(prompts_for(VOCAB, [16, 16, 16])):
                core.add_request(f"r{i}", prompt, PARAMS, prefill_only=True)

        await served.call(add)
        for _ in range(300):
            if len(steps) >= 3:
                break
            await asyncio.sleep(0.01)
    finally:
        served.close()
    assert len(steps) >= 3, steps
    assert steps[1][2] == []  # r1's step: its only member aborted
    assert steps[2][2] == ["r2"]
    assert steps[2][0] - steps[1][1] < 0.025, f"{(steps[2][0] - steps[1][1]) * 1e3:.1f} ms before reading r2's step"

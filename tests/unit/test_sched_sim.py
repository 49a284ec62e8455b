"""The scheduling simulator: its step-cost model reads a step_cost table as measured, and a run through the real
scheduler times tokens by it."""

from __future__ import annotations

import pytest

from tandem.benchmarks.sched_sim import StepCost, simulate
from tandem.common.config import SchedulerConfig

# A step_cost table's rows (wall ms by prompt tokens P and decoding requests D), shaped like the H200's.
ROWS = [{"prompt_tokens": p, "decodes": d, "wall_ms": ms} for p, d, ms in [
    (128, 0, 6.0), (1024, 0, 24.0), (2048, 0, 48.0),
    (0, 16, 6.4), (128, 16, 10.0), (1024, 16, 28.0), (2048, 16, 56.0),
    (0, 64, 8.0), (128, 64, 11.0), (1024, 64, 31.0), (2048, 64, 59.0)]]


def test_step_cost_reads_the_table_between_and_past_its_rows() -> None:
    cost = StepCost(ROWS, decode_slope_ms=0.05)
    assert cost.ms(1024, 16) == pytest.approx(28.0) and cost.ms(128, 64) == pytest.approx(11.0)
    assert cost.ms(576, 0) == pytest.approx(15.0)  # halfway between 128 and 1,024 prompt tokens
    assert cost.ms(3072, 0) == pytest.approx(72.0)  # past the last prompt size, on its last slope
    assert cost.ms(0, 40) == pytest.approx(7.2)  # between decode rows
    assert cost.ms(0, 164) == pytest.approx(13.0)  # past the last decode row: 0.05 ms per request
    assert cost.ms(0, 0) == pytest.approx(6.4 - 16 * (8.0 - 6.4) / 48)  # decode-only rows extrapolated to none
    # Beside prompt tokens, a few decodes cost the first decode row (their attention's fixed share).
    assert cost.ms(1024, 1) == pytest.approx(28.0) and cost.ms(1024, 0) == pytest.approx(24.0)


def test_a_lone_request_takes_its_prompt_step_then_one_decode_step_per_token() -> None:
    cost = StepCost(ROWS, decode_slope_ms=0.05)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, enable_chunked_prefill=True)
    run = simulate(cost.ms, rate=1e-6, num_requests=1, prompt_len=1024, output_len=5, config=config,
                   overhead_ms=1.0, seed=0)
    decode_ms = cost.ms(0, 1) + 1.0
    assert run["steps"] == 5  # the prompt's step samples the first token, then 4 decode steps
    assert run["ttft_s"]["p50"] == pytest.approx((24.0 + 1.0) / 1e3)
    assert run["tpot_s"]["p50"] == pytest.approx(decode_ms / 1e3)
    assert run["itl_s"]["p99"] == pytest.approx(decode_ms / 1e3)


def test_every_request_finishes_and_a_smaller_budget_shortens_the_longest_gap() -> None:
    cost = StepCost(ROWS, decode_slope_ms=0.05)
    runs = {}
    for budget in (2048, 512):
        config = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget, enable_chunked_prefill=True)
        runs[budget] = simulate(cost.ms, rate=16.0, num_requests=24, prompt_len=1024, output_len=32, config=config,
                                overhead_ms=0.0, seed=1)
        assert runs[budget]["output_tok_per_s"] > 0 and runs[budget]["goodput_rps"] > 0
    # Whole 1,024-token prompts beside decodes stall them ~28 ms; 512-token chunks ~half as long.
    assert runs[512]["itl_s"]["p99"] < runs[2048]["itl_s"]["p99"]

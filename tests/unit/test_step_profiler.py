"""`TANDEM_PROFILE_STEPS` / `TANDEM_PROFILE_DIR`: a served engine thread's steps under torch.profiler, written as a
Chrome trace, an operator table and per-step times; a bad value is an error naming the variable."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from tandem.benchmarks.profile_steps import summarize
from tandem.common.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.models import load_model_config
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.profiling import StepProfiler, StepRange, parse_step_ranges


def test_ranges_parse() -> None:
    assert parse_step_ranges("prefill:1-40, decode:100-400@2") == {"prefill": (1, 40, 1), "decode": (100, 400, 2)}
    assert parse_step_ranges("decode: 3 - 4 @ 3") == {"decode": StepRange(first=3, last=4, period=3)}
    assert parse_step_ranges("") == {}


@pytest.mark.parametrize("value", ["decode", "decode:5", "decode:0-3", "decode:9-3", "decode:1-2,decode:3-4",
                                   "Decode:1-2", "decode:1-2@0", "decode:1-2@"])
def test_bad_ranges_name_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match="TANDEM_PROFILE_STEPS"):
        parse_step_ranges(value)


def test_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_PROFILE_STEPS", "decode:3-5@2")
    monkeypatch.setenv("TANDEM_PROFILE_DIR", str(tmp_path))
    assert StepProfiler.from_env("prefill") is None
    profiler = StepProfiler.from_env("decode")
    assert profiler is not None
    assert (profiler.first, profiler.last, profiler.period, profiler.out_dir) == (3, 5, 2, tmp_path)
    monkeypatch.setenv("TANDEM_PROFILE_STEPS", "decode:x")
    with pytest.raises(ConfigError, match="TANDEM_PROFILE_STEPS"):
        StepProfiler.from_env("decode")


async def test_the_profiled_steps_are_written(tmp_path: Path) -> None:
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=16, num_blocks=16),
                          scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64))
    profiler = StepProfiler("decode", first=2, last=4, out_dir=tmp_path)
    engine = AsyncEngine(Engine(config), profiler=profiler)
    try:
        with engine.stream("r") as stream:
            await engine.call(lambda e: e.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=8)))
            while (await stream.next()).finish_reason is None:
                pass
    finally:
        engine.close()
    assert profiler.done and profiler.num_steps == 4  # it stops counting once written
    stem = profiler.stem
    steps = json.loads(Path(f"{stem}.steps.json").read_text())
    assert [s["step"] for s in steps["steps"]] == [2, 3, 4]
    assert all(s["wall_ms"] > 0 and s["batch_size"] == 1 and s["num_tokens"] == 1 for s in steps["steps"])
    trace = json.loads(gzip.decompress(Path(f"{stem}.trace.json.gz").read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"decode step 2", "decode step 3", "decode step 4"} <= names and "decode step 5" not in names
    assert "aten::" in Path(f"{stem}.ops.txt").read_text()  # the model's operators, by self time


def _config() -> EngineConfig:
    return EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                        cache=CacheConfig(block_size=16, num_blocks=16),
                        scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64))


async def _serve_one(engine: AsyncEngine, req_id: str, max_tokens: int, first_token: int = 1) -> None:
    prompt = list(range(first_token, first_token + 19))  # distinct first tokens: no prefix cache hit
    with engine.stream(req_id) as stream:
        await engine.call(lambda e: e.add_request(req_id, prompt, SamplingParams(max_tokens=max_tokens)))
        while (await stream.next()).finish_reason is None:
            pass


async def test_busy_periods_skip_a_warm_up_and_an_idle_gap_writes_the_range(tmp_path: Path) -> None:
    """`@2`: the steps counted from the second busy period; the range is written once that period goes idle,
    although it never reached its last step."""
    profiler = StepProfiler("decode", first=1, last=50, out_dir=tmp_path, period=2, idle_gap_s=0.3)
    engine = AsyncEngine(Engine(_config()), profiler=profiler)
    try:
        await _serve_one(engine, "warm-up", max_tokens=6)  # period 1: not profiled
        assert profiler.num_periods == 1 and not profiler.done
        await asyncio.sleep(0.5)  # an idle gap longer than idle_gap_s: the next step opens period 2
        await _serve_one(engine, "measured", max_tokens=4, first_token=100)
        assert profiler.num_periods == 2
        for _ in range(40):  # the engine thread notices the gap within its 0.5 s idle wait
            if profiler.done:
                break
            await asyncio.sleep(0.1)
    finally:
        engine.close()
    assert profiler.done
    steps = json.loads(Path(f"{profiler.stem}.steps.json").read_text())
    assert steps["period"] == 2
    # One prefill step (the first token) and three decode steps: the warm-up's six steps are not among them.
    assert [s["step"] for s in steps["steps"]] == [1, 2, 3, 4]
    assert [s["num_tokens"] for s in steps["steps"]] == [19, 1, 1, 1]


def test_profile_steps_summarizes_a_written_trace(tmp_path: Path) -> None:
    """`python -m tandem.benchmarks.profile_steps` over the files a profiled engine wrote: every profiled step, each
    with the host operators inside its window (on the CPU there are no kernels: GPU time 0)."""
    profiler = StepProfiler("prefill", first=1, last=3, out_dir=tmp_path)
    engine = AsyncEngine(Engine(_config()), profiler=profiler)
    try:
        asyncio.run(_serve_one(engine, "r", max_tokens=3))
    finally:
        engine.close()
    # Every op of each step (not the default top 3: on a busy machine a step's longest host events need not be aten's).
    summary = summarize(Path(f"{profiler.stem}.trace.json.gz"), Path(f"{profiler.stem}.steps.json"), top_ops=10_000)
    assert summary["role"] == "prefill" and summary["num_steps"] == 3
    assert [row["step"] for row in summary["steps"]] == [1, 2, 3]
    for row in summary["steps"]:
        assert row["gpu_ms"] == 0 and row["num_kernels"] == 0
        assert row["longest_ops"] and all(op["ms"] <= row["wall_ms"] * 1.5 for op in row["longest_ops"])
        assert any(op["name"].startswith("aten::") for op in row["longest_ops"])

"""`TANDEM_PROFILE_STEPS` / `TANDEM_PROFILE_DIR`: a served engine thread's steps under torch.profiler, written as a
Chrome trace, an operator table and per-step times; a bad value is an error naming the variable."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tandem.common.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.models import load_model_config
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.profiling import StepProfiler, parse_step_ranges


def test_ranges_parse() -> None:
    assert parse_step_ranges("prefill:1-40, decode:100-400") == {"prefill": (1, 40), "decode": (100, 400)}
    assert parse_step_ranges("") == {}


@pytest.mark.parametrize("value", ["decode", "decode:5", "decode:0-3", "decode:9-3", "decode:1-2,decode:3-4",
                                   "Decode:1-2"])
def test_bad_ranges_name_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match="TANDEM_PROFILE_STEPS"):
        parse_step_ranges(value)


def test_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_PROFILE_STEPS", "decode:3-5")
    monkeypatch.setenv("TANDEM_PROFILE_DIR", str(tmp_path))
    assert StepProfiler.from_env("prefill") is None
    profiler = StepProfiler.from_env("decode")
    assert profiler is not None and (profiler.first, profiler.last, profiler.out_dir) == (3, 5, tmp_path)
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

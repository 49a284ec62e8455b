"""The engine thread reserves a remote-prefill request's blocks as soon as it has queued it, between steps (not in
the next step's admission), and a failure there fails the requests in flight instead of stranding them."""

from __future__ import annotations

import pytest

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine, StepResult
from tandem.models import load_model_config
from tandem.serving.async_engine import AsyncEngine, EngineFailure, ReservedEvent


def make_engine() -> AsyncEngine:
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=16, num_blocks=16),
                          scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64))
    return AsyncEngine(Engine(config))


async def test_the_reservation_comes_before_any_step() -> None:
    engine = make_engine()
    steps: list[StepResult] = []
    engine.on_step = lambda result, seconds: steps.append(result)
    try:
        with engine.stream("r") as stream:
            await engine.call(lambda e: e.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=4),
                                                      remote_prefill=True))
            event = await stream.next()
            assert isinstance(event, ReservedEvent) and len(event.block_ids) == 3
            assert all(not result.reserved for result in steps)  # no step's admission reserved it
    finally:
        engine.close()


async def test_a_failed_reservation_fails_the_request_in_flight() -> None:
    engine = make_engine()
    original = engine.engine.reserve_waiting
    calls: list[int] = []

    def broken() -> list:
        if engine.engine.scheduler.waiting and not calls:  # once, when there is something to reserve
            calls.append(1)
            raise RuntimeError("pool corrupted")
        return original()

    engine.engine.reserve_waiting = broken  # type: ignore[method-assign]
    try:
        with engine.stream("r") as stream:
            await engine.call(lambda e: e.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=4),
                                                      remote_prefill=True))
            with pytest.raises(EngineFailure, match="pool corrupted"):
                await stream.next()
        assert "r" not in engine.engine.requests and not engine.engine.scheduler.waiting  # aborted, nothing held
        engine.engine.block_pool.check_integrity()
    finally:
        engine.close()

"""The decode-latency benchmarks' step timing under async scheduling (`steady_step_times`, `check_floor`).

A fake engine stands in for the GPU's queue: each `step()` launches one step and waits for the one launched before,
as `Engine.step` does with async scheduling. A synchronisation before each call (what the benchmarks did) empties
that queue, and the call then only costs the host's part."""

from __future__ import annotations

import time

import pytest

from tandem.benchmarks.gpu_engine import check_floor, steady_step_times

GPU_STEP_S = 0.02
HOST_S = 0.001


class QueuedEngine:
    """`step()` queues a step of GPU_STEP_S behind the ones queued, then returns once the one before it is done."""

    def __init__(self) -> None:
        self.done_at: list[float] = []  # when each launched step ends on the "GPU"
        self.results = 0

    def step(self) -> int:
        time.sleep(HOST_S)
        now = time.perf_counter()
        self.done_at.append(max(now, self.done_at[-1] if self.done_at else now) + GPU_STEP_S)
        if len(self.done_at) >= 2:  # wait for the step launched before this one
            time.sleep(max(0.0, self.done_at[-2] - time.perf_counter()))
        self.results += 1
        return self.results

    def synchronize(self) -> None:
        if self.done_at:
            time.sleep(max(0.0, self.done_at[-1] - time.perf_counter()))


def test_back_to_back_steps_show_the_gpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = QueuedEngine()
    monkeypatch.setattr("tandem.benchmarks.gpu_engine.sync", lambda device: engine.synchronize())
    seen: list[int] = []
    times = steady_step_times(engine, 8, "cuda", seen.append)
    assert seen == list(range(1, 10))  # the untimed call's result too
    median = sorted(times)[len(times) // 2]
    assert GPU_STEP_S * 0.9 < median < GPU_STEP_S * 1.5


def test_syncing_before_each_step_would_time_the_host_only() -> None:
    """What the earlier timing measured: the reason for `steady_step_times`."""
    engine = QueuedEngine()
    engine.step()
    times = []
    for _ in range(5):
        engine.synchronize()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    assert max(times) < GPU_STEP_S / 2


def test_a_step_faster_than_its_floor_is_refused() -> None:
    row = {"model": "m", "variant": "bf16", "batch": 1, "step_ms": 0.4, "floor_ms": 3.5, "fraction_of_floor": 8.75}
    with pytest.raises(RuntimeError, match="does not wait for the GPU"):
        check_floor(row)
    check_floor({**row, "step_ms": 5.0, "fraction_of_floor": 0.7})

"""Commands that may run while a launched decode step computes (`AsyncEngine.call(..., mid_step=True)`: adding a
request, its reservation, an activation) run before the step ends; every other command, and anything queued behind
one, waits for the step's end, in order. On the CPU a launched step has already run, so its "GPU" is faked here: a
gate the test opens stands for the step finishing."""

from __future__ import annotations

import asyncio
import threading

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.models import load_model_config
from tandem.serving.async_engine import AsyncEngine, ReservedEvent


class GatedStep:
    """A launched step's CUDA event as the host sees it: done once the gate opens."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        self.gate.wait()


def gated_engine(gate: threading.Event) -> AsyncEngine:
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=16, num_blocks=32),
                          scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=128),
                          async_scheduling=True)
    engine = Engine(config)
    launch = engine.runner.launch_decode

    def gated_launch(*args):  # type: ignore[no-untyped-def]
        launched = launch(*args)
        launched.done = GatedStep(gate)  # type: ignore[assignment]
        return launched

    engine.runner.launch_decode = gated_launch  # type: ignore[method-assign]
    return AsyncEngine(engine)


async def wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_admission_and_reservation_run_while_a_step_computes_other_commands_wait_in_order() -> None:
    gate = threading.Event()
    engine = gated_engine(gate)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    try:
        await engine.call(lambda e: e.add_request("running", list(range(1, 20)), greedy))
        await wait_until(lambda: engine.engine._in_flight is not None)  # a decode step launched, "on the GPU"
        with engine.stream("remote") as stream:
            await asyncio.wait_for(engine.call(lambda e: e.add_request(
                "remote", list(range(1, 40)), greedy, remote_prefill=True), mid_step=True), 5)
            event = await asyncio.wait_for(stream.next(), 5)  # reserved while the step still computes
            assert isinstance(event, ReservedEvent) and len(event.block_ids) == 3
            assert not gate.is_set()
            order: list[str] = []
            plain = asyncio.ensure_future(engine.call(lambda e: order.append("plain")))
            behind = asyncio.ensure_future(engine.call(lambda e: order.append("behind"), mid_step=True))
            await asyncio.sleep(0.3)
            assert not plain.done() and not behind.done()  # the step has not ended: neither ran, nor overtook
            gate.set()
            await asyncio.wait_for(asyncio.gather(plain, behind), 5)
            assert order == ["plain", "behind"]
            await engine.call(lambda e: e.abort("remote"))
        await engine.call(lambda e: e.abort("running"))
        await wait_until(lambda: not engine.engine.has_unfinished())
        engine.engine.block_pool.check_integrity()
    finally:
        gate.set()
        engine.close()

"""Warm-up's step at the whole token budget (on a GPU it makes the caching allocator take the largest step's
activations before the first burst): one step of `max_num_batched_tokens` prompt tokens, bounded by the pool, and
nothing of it left behind. Run here on the CPU by calling the GPU-only part directly."""

from __future__ import annotations

import pytest

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.models import load_model_config


def make_engine(num_blocks: int, budget: int, max_model_len: int = 40) -> Engine:
    return Engine(EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                               cache=CacheConfig(block_size=8, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=budget,
                                                         max_num_seqs=8)))


def step_sizes(engine: Engine) -> list[int]:
    sizes: list[int] = []
    step = engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        result = step()
        sizes.append(sum(result.num_new_tokens))
        return result

    engine.step = recording_step  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize(("num_blocks", "budget", "expected"), [
    (64, 96, [78]),  # two prompts of max_model_len - 1 = 39 tokens fill 78 of the 96
    (64, 30, [30]),  # a budget below max_model_len: one prompt of the whole budget
    (8, 96, [39]),  # 7 spare blocks of 8 tokens hold one prompt of 39, not two
])
def test_the_full_step_fills_the_budget_and_frees_everything(num_blocks: int, budget: int,
                                                             expected: list[int]) -> None:
    engine = make_engine(num_blocks, budget)
    free_before = engine.block_pool.num_free_blocks
    sizes = step_sizes(engine)
    engine._warm_up_full_step()
    assert sizes == expected
    assert not engine.requests and engine.block_pool.num_free_blocks == free_before
    # The engine serves as before.
    engine.add_request("r", [5, 9, 200, 31], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()

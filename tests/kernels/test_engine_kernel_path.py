"""The engine on the Triton path (Triton's interpreter on the CPU): the kernels are what ran, and the
tokens equal the reference path's on the same weights."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.runner import ModelRunner
from tandem.kernels import Ops, get_ops, triton_available
from tandem.models import load_model_config

OPS = [f.name for f in dataclasses.fields(Ops) if f.name != "name"]


def counted(ops: Ops, calls: Counter[str]) -> Ops:
    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    return dataclasses.replace(ops, **{name: wrap(name, getattr(ops, name)) for name in OPS})


def run(backend: str, calls: Counter[str]) -> list[list[int]]:
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=8, num_blocks=32),
                          scheduler=SchedulerConfig(max_model_len=96, max_num_batched_tokens=128))
    engine = Engine(config, ModelRunner(config, ops=counted(get_ops(backend), calls)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 200, 31], list(range(100, 123))]  # 4 and 23 tokens: a partial block each
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in requests]


@pytest.mark.skipif(not triton_available(torch.device("cpu")) and not torch.cuda.is_available(),
                    reason="needs triton (its interpreter on CPU)")
def test_engine_runs_the_kernels_and_matches_the_reference() -> None:
    kernel_calls: Counter[str] = Counter()
    reference_calls: Counter[str] = Counter()
    assert run("triton", kernel_calls) == run("torch", reference_calls)
    # Every op ran on the kernel path: 2 layers x (1 prefill + 5 decode steps), plus the final norm.
    assert set(kernel_calls) == set(OPS) and kernel_calls == reference_calls
    assert kernel_calls["paged_decode_attention"] == 2 * 5 and kernel_calls["prefill_attention"] == 2

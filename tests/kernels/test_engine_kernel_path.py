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

OPS = [f.name for f in dataclasses.fields(Ops) if f.name not in ("name", "fusions")]
# What the model never calls itself: rope_store_kv is RoPE and the KV store (fused or one after the other), and
# store_kv alone is only the prefill role's second store into a peer's pool (tests/kernels/test_fused_decode_layer).
NOT_CALLED_BY_THE_MODEL = {"rotary_embedding", "store_kv"}


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
                          # A budget of 16 tokens: the 23-token prompt is computed in two chunks, the second over
                          # the first's pages (paged prefill attention) beside the other request's decode tokens.
                          scheduler=SchedulerConfig(max_model_len=96, max_num_batched_tokens=16))
    engine = Engine(config, ModelRunner(config, ops=counted(get_ops(backend, "all"), calls)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 200, 31], list(range(100, 123))]  # 4 and 23 tokens: a partial block each
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in requests]


@pytest.mark.skipif(not triton_available(torch.device("cpu")),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1): this engine runs on the CPU")
def test_engine_runs_the_kernels_and_matches_the_reference() -> None:
    kernel_calls: Counter[str] = Counter()
    reference_calls: Counter[str] = Counter()
    assert run("triton", kernel_calls) == run("torch", reference_calls)
    # Every op the model calls ran on the kernel path, as often as on the reference path: step 1 prefills the
    # 4-token prompt and the first 12 tokens of the other (contiguous prefill); step 2 decodes the first beside the
    # second's last 11 tokens (decode + paged prefill); 5 decode-only steps follow.
    assert set(kernel_calls) == set(OPS) - NOT_CALLED_BY_THE_MODEL and kernel_calls == reference_calls
    assert kernel_calls["prefill_attention"] == 2 and kernel_calls["paged_prefill_attention"] == 2
    assert kernel_calls["paged_decode_attention"] == 2 * 6


@pytest.mark.skipif(not triton_available(torch.device("cpu")),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1): this engine runs on the CPU")
def test_warm_up_runs_every_attention_layout_and_changes_nothing() -> None:
    """`Engine.warm_up` launches the attention kernels at each tile size and decode split layout an eager step can
    pick (the compiles a first request would otherwise wait for), and the engine's tokens stay as without it."""
    calls: Counter[str] = Counter()
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=8, num_blocks=64),
                          scheduler=SchedulerConfig(max_model_len=160, max_num_batched_tokens=16, max_num_seqs=8))
    runner = ModelRunner(config, ops=counted(get_ops("triton", "all"), calls))
    runner.warm_up_attention()
    # Twelve lengths up to 129 (the contiguous and the paged prefill kernel each), one decode launch per layout.
    assert calls["prefill_attention"] == 12 and calls["paged_prefill_attention"] == 12
    layouts = {(1 << (runner.num_splits_for(n) - 1).bit_length(), runner.num_splits_for(n) == 1) for n in range(1, 9)}
    assert calls["paged_decode_attention"] == len(layouts) >= 1
    engine = Engine(config, runner)
    engine.warm_up()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    warm = engine.add_request("a", list(range(100, 123)), params)
    while engine.has_unfinished():
        engine.step()
    cold = Engine(config, ModelRunner(config, ops=get_ops("triton", "all")))
    fresh = cold.add_request("a", list(range(100, 123)), params)
    while cold.has_unfinished():
        cold.step()
    assert warm.output_token_ids == fresh.output_token_ids

"""Warm-up reaches every kernel variant that requests launch (Triton's interpreter on the CPU): on a GPU a variant
first launched by a request compiles while that request waits (0.5-3 s on an H200)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.request import KVMirror, RequestStatus
from tandem.engine.runner import ModelRunner
from tandem.kernels import Ops, get_ops
from tandem.models import load_model_config

pytestmark = pytest.mark.usefixtures("needs_triton")

OPS = [f.name for f in dataclasses.fields(Ops) if f.name not in ("name", "fusions")]
Launch = tuple[str, tuple[str, ...]]


def recorded(ops: Ops, launches: set[Launch]) -> Ops:
    """`ops` noting each call as (op, its tensor arguments' dtypes in order): what Triton specialises a kernel on
    besides alignment and integer values. An `out` is left out: it has q's dtype (the ops check), and without
    one the op allocates it, so the kernel is the same."""
    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *(v for k, v in kwargs.items() if k != "out")) if isinstance(a, torch.Tensor)]
            launches.add((name, tuple(str(t.dtype) for t in tensors)))
            return fn(*args, **kwargs)
        return call
    return dataclasses.replace(ops, **{name: wrap(name, getattr(ops, name)) for name in OPS})


def test_warm_up_launches_what_mirrored_and_mixed_steps_launch() -> None:
    launches: set[Launch] = set()
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=8, num_blocks=48),
                          scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4))
    engine = Engine(config, ModelRunner(config, ops=recorded(get_ops("triton", "all"), launches)))
    engine.warm_up()
    warmed, launches_before = set(launches), len(launches)
    launches.clear()

    # The prefill role: a prompt whose K/V also go into a peer pool on this device (its own chunks, 2 of 16).
    peer = torch.zeros_like(engine.runner.kv_cache.tensor)
    layers = [(peer[i, 0], peer[i, 1]) for i in range(peer.shape[0])]
    mirrored = engine.add_request("mirrored", list(range(300, 319)), SamplingParams(max_tokens=1, seed=0),
                                  prefill_only=True, kv_mirror=KVMirror(layers, [5, 9, 2]))
    while mirrored.status != RequestStatus.PREFILLED:
        engine.step()
    assert ("store_kv", ("torch.float32",) * 4 + ("torch.int64",)) in launches, launches  # the mirror's store ran
    assert peer.abs().sum() > 0
    # Decode and mixed steps: a running request beside another's chunks.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 9, 200, 31], params)
    engine.add_request("b", list(range(100, 123)), params)
    while any(r.status in (RequestStatus.WAITING, RequestStatus.RUNNING) for r in engine.requests.values()):
        engine.step()
    assert launches_before > 0 and launches - warmed == set()

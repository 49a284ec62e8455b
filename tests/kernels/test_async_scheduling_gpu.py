"""Async scheduling on a GPU, where a launch really runs ahead of the host: the same tokens as steps run one at a
time (greedy and seeded, with stop tokens and length limits), and every block back."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tokens_equal_steps_one_at_a_time_on_the_gpu() -> None:
    prompts = [[(7 * i + 3 * j + 2) % 500 + 2 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=8 + 7 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    params += [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(6)]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM("dummy:tiny", device="cuda", max_model_len=256, max_num_seqs=16, num_kv_blocks=256,
                  async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling == async_scheduling
        outputs[async_scheduling] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
        llm.engine.block_pool.check_integrity()
        del llm
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]
    assert [len(t) for t in outputs[True]] == [p.max_tokens for p in params]

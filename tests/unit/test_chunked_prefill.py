"""Chunked prefill end to end: prompts longer than the step's token budget, computed in chunks in steps shared
with other requests' decode tokens, give the same greedy tokens as whole-prompt prefill and as HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tests.factories import hf_greedy, prompts_for, save_random_hf_model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("budget", [16, 64, 256])
def test_chunks_equal_whole_prompts_and_hf(tmp_path: Path, budget: int) -> None:
    hf = save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [70, 3, 150, 17, 33])  # several longer than the small budgets
    whole = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=256, enable_chunked_prefill=False,
                block_size=8)
    chunked = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=budget, block_size=8)
    expected = [o.token_ids for o in whole.generate(prompts, greedy(12))]
    assert [o.token_ids for o in chunked.generate(prompts, greedy(12))] == expected
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert tokens == hf_greedy(hf, prompt, 12)
    chunked.engine.block_pool.check_integrity()
    assert chunked.engine.num_free_blocks == chunked.engine.num_total_blocks


def test_seeded_sampling_is_unchanged_by_chunking(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [60, 9, 41])
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    runs = [LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=budget, block_size=4).generate(prompts, params)
            for budget in (128, 8)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_max_model_len_beyond_the_budget_and_preemption_mid_prompt(tmp_path: Path) -> None:
    """A budget far below the context, and a pool that makes requests give way part-way through their prompts."""
    hf = save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [90, 80, 70])
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt
    preempted_mid_prompt = []

    def recording(request):  # type: ignore[no-untyped-def]
        preempted_mid_prompt.append(request.is_prefilling and request.num_computed_tokens > 0)
        return preempt(request)

    scheduler._preempt = recording  # type: ignore[method-assign]
    outputs = llm.generate(prompts, greedy(20))
    assert any(preempted_mid_prompt), "the pool should have preempted a request part-way through its prompt"
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf, prompt, 20)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.slow
def test_smollm2_chunked_equals_hf(smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    prompts = prompts_for(49152, [300, 45])
    for budget in (64, 256):
        llm = LLM(str(smollm2_path), max_model_len=512, max_num_batched_tokens=budget)
        outputs = llm.generate(prompts, greedy(8))
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.token_ids == hf_greedy(hf, prompt, 8), budget


def test_default_budget_by_device_and_role() -> None:
    """GPU workers take 2,048 tokens a step (prompts of ~1k in one step: smaller chunks cost as much), a GPU prefill
    worker 8,192 (no decode tokens to protect), the CPU 256; without chunking the budget must hold whole prompts."""
    from tandem.common.config import SchedulerConfig, default_batched_tokens

    assert default_batched_tokens("cuda") == default_batched_tokens("cuda:1", role="decode") == 2048
    assert default_batched_tokens("cuda", role="prefill") == 8192
    assert default_batched_tokens("cpu") == default_batched_tokens("cpu", role="prefill") == 256
    assert default_batched_tokens("cuda", enable_chunked_prefill=False, role="prefill") == 8192
    assert SchedulerConfig().resolved("cuda").max_num_batched_tokens == 2048

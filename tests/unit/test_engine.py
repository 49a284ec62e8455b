"""The engine end to end in-process: token-exact against HF transformers, batching, paging, sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.common.config import ConfigError
from tandem.common.errors import InvalidRequestError
from tests.factories import hf_greedy, prompts_for, save_random_hf_model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


PROMPT_LENS = [1, 5, 16, 17, 40]


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_random_llama_matches_hf_greedy(tmp_path: Path, rope: str) -> None:
    overrides: dict[str, object] = {}
    if rope == "llama3":
        overrides["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
    hf = save_random_hf_model(tmp_path, **overrides)
    llm = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=256, block_size=8)
    prompts = prompts_for(512, PROMPT_LENS)
    outputs = llm.generate(prompts, greedy(20))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf, prompt, 20)
        assert output.finish_reason == "length"
    llm.engine.block_pool.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_tied_embeddings_and_dummy_tiny_shape(tmp_path: Path) -> None:
    from tandem.models import load_model_config

    tiny = load_model_config("dummy:tiny", fetch=False)
    hf = save_random_hf_model(
        tmp_path, vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim, tie_word_embeddings=True)
    hf.tie_weights()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=128)
    prompts = prompts_for(tiny.vocab_size, [3, 30])
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(12)), strict=True):
        assert output.token_ids == hf_greedy(hf, prompt, 12)


def test_batch_invariance_and_preemption_under_a_tiny_pool(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [9, 23, 4, 31, 12, 7])
    roomy = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=128, block_size=4)
    alone = [roomy.generate([p], greedy(24))[0].token_ids for p in prompts]
    together = [o.token_ids for o in roomy.generate(prompts, greedy(24))]
    assert together == alone
    # 16 blocks of 4 tokens cannot hold six requests growing to 30-55 tokens: some are preempted
    # and recomputed, and the output must not change.
    tight = LLM(str(tmp_path), max_model_len=64, max_num_batched_tokens=128, block_size=4, num_kv_blocks=16)
    requests_before = sum(1 for _ in prompts)
    outputs = tight.generate(prompts, greedy(24))
    assert [o.token_ids for o in outputs] == alone and requests_before == len(outputs)
    tight.engine.block_pool.check_integrity()
    assert tight.engine.num_free_blocks == 16


def test_preemption_happens_in_tight_pool(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64, max_num_batched_tokens=128, block_size=4, num_kv_blocks=16)
    for i, prompt in enumerate(prompts_for(512, [20, 20, 20])):
        llm.engine.add_request(f"r{i}", prompt, greedy(30))
    preempted = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        preempted = max(preempted, sum(r.num_preemptions for r in llm.engine.requests.values()))
    assert preempted > 0
    llm.engine.block_pool.check_integrity()


def test_seeded_sampling_reproduces_across_batches(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=128)
    prompts = prompts_for(512, [5, 11, 17])
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = llm.generate(prompts[1], params[1])[0].token_ids
    assert alone == together[1]
    other_seed = llm.generate(prompts[1], SamplingParams(max_tokens=16, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != together[1]


def test_bad_input_is_rejected_before_allocation(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64, max_num_batched_tokens=64, block_size=4, num_kv_blocks=16)
    cases = [
        ([[]], SamplingParams(), "prompt"),
        ([[3] * 64], SamplingParams(), "prompt"),
        ([[3] * 10], SamplingParams(max_tokens=60), "max_tokens"),
        ([[3, 512]], SamplingParams(), "prompt_token_ids"),
        ([[3, -1]], SamplingParams(), "prompt_token_ids"),
    ]
    for prompts, params, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompts, params)
        assert info.value.field == field
    for field, kwargs in [("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -1.0}),
                          ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}), ("top_k", {"top_k": -1})]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)  # type: ignore[arg-type]
        assert info.value.field == field
    # A valid batch after a rejected one: nothing was left allocated.
    assert llm.engine.num_free_blocks == 16
    # A pool that cannot hold even one request of the maximum length is refused at start-up, so
    # every admitted request can always run to its end (after preempting others if need be).
    with pytest.raises(ConfigError, match="num_blocks"):
        LLM(str(tmp_path), max_model_len=64, max_num_batched_tokens=64, block_size=4, num_kv_blocks=4)

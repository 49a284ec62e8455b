"""Speculative decoding in the engine (n-gram prompt lookup): several tokens per target forward on text that
repeats itself, and exactly the tokens of decoding one at a time: greedy, seeded, stopped mid-proposal by a stop
token or by max_tokens, with prefix caching and chunking on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.common.config import ConfigError
from tests.factories import prompts_for, save_random_hf_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _repetitive_prompts() -> list[list[int]]:
    pattern = prompts_for(512, [9])[0]
    return [pattern * 6, prompts_for(512, [25])[0], (pattern[:4] + [7, 8]) * 5]


def _llms(folder: Path, **kwargs: object) -> tuple[LLM, LLM]:
    plain = LLM(str(folder), max_model_len=256, block_size=8, **kwargs)  # type: ignore[arg-type]
    spec = LLM(str(folder), max_model_len=256, block_size=8, speculative_config=SPEC, **kwargs)  # type: ignore[arg-type]
    return plain, spec


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, top_k=5, seed=12, ignore_eos=True),
], ids=["greedy", "seeded-top-p", "seeded-top-k"])
def test_same_tokens_as_one_at_a_time(tmp_path: Path, params: SamplingParams) -> None:
    save_random_hf_model(tmp_path)
    plain, spec = _llms(tmp_path)
    prompts = _repetitive_prompts()
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.engine.num_free_blocks == spec.engine.num_total_blocks
    spec.engine.block_pool.check_integrity()


@pytest.mark.slow
def test_it_speculates_and_accepts_when_the_model_copies(smollm2_path: Path) -> None:
    """SmolLM2 asked to repeat a text: the proposals (the text itself) are mostly accepted, so there are far
    fewer target forwards than tokens, and the tokens are those of decoding one at a time."""
    text = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
            "the members agreed to fund the reading room, the children's corner and a small cafe.")
    messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{text}"}]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM(str(smollm2_path), max_model_len=512)
    spec = LLM(str(smollm2_path), max_model_len=512, speculative_config=SPEC)
    steps: list[tuple[int, int]] = []
    step = spec.engine.step

    def recording():  # type: ignore[no-untyped-def]
        result = step()
        steps.append((result.num_draft_tokens, result.num_accepted_tokens))
        return result

    spec.engine.step = recording  # type: ignore[method-assign]
    got = spec.chat(messages, params)[0]
    assert got.token_ids == plain.chat(messages, params)[0].token_ids
    drafted, accepted = sum(d for d, _ in steps), sum(a for _, a in steps)
    assert accepted >= 0.5 * drafted > 0
    assert len(steps) < 0.7 * len(got.token_ids)  # fewer target forwards than tokens


def test_no_proposals_while_the_batch_is_at_disable_by_batch_size(tmp_path: Path) -> None:
    """Three repetitive prompts together (3 running) with disable_by_batch_size 3: no step verifies proposals while all
    three run; the same tokens as decoding one at a time; alone, a request speculates again."""
    save_random_hf_model(tmp_path)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tmp_path), max_model_len=256, block_size=8)
    spec = LLM(str(tmp_path), max_model_len=256, block_size=8,
               speculative_config=SPEC | {"disable_by_batch_size": 3})
    drafted: list[tuple[int, int]] = []  # (running requests, tokens drafted) per step
    step = spec.engine.step

    def recording():  # type: ignore[no-untyped-def]
        running = len(spec.engine.scheduler.running)
        result = step()
        drafted.append((running, result.num_draft_tokens))
        return result

    spec.engine.step = recording  # type: ignore[method-assign]
    prompts = _repetitive_prompts()
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert all(num == 0 for running, num in drafted if running >= 3)
    drafted.clear()
    spec.generate(prompts[:1], params)
    assert sum(num for _, num in drafted) > 0


def test_stop_token_and_max_tokens_mid_proposal(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    plain, spec = _llms(tmp_path)
    prompts = _repetitive_prompts()
    free = plain.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        stop = free[i].token_ids[17]  # a token produced mid-run
        params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
        expected = plain.generate([prompt], params)[0]
        got = spec.generate([prompt], params)[0]
        assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
        for max_tokens in (1, 2, 7, 13):
            limited = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            assert spec.generate([prompt], limited)[0].token_ids == free[i].token_ids[:max_tokens]


def test_chunked_prefill_and_a_small_pool_with_speculation(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    plain, spec = _llms(tmp_path, max_num_batched_tokens=12, num_kv_blocks=40)
    prompts = _repetitive_prompts()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.engine.num_free_blocks == spec.engine.num_total_blocks


def test_bad_speculative_configs_are_refused(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    with pytest.raises(ConfigError, match="^model: the draft model 'dummy:tiny' has a vocabulary"):
        LLM(str(tmp_path), max_model_len=64, speculative_config={"method": "draft_model", "model": "dummy:tiny",
                                                                 "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="unsupported key"):
        LLM(str(tmp_path), max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                 "bogus": 1})

"""Speculative decoding with a draft model: a draft equal to the target accepts every greedy proposal; any draft
leaves greedy and seeded output token for token that of decoding one at a time (stopped mid-proposal by a stop
token, max_tokens or a stop string, with chunked prefill, prefix caching and preemption, and on a disaggregated
decode worker that computes the draft's K/V of the prompt itself); unseeded sampling keeps the target's
distribution (rejection sampling); every block is freed at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tandem import LLM, SamplingParams
from tandem.common.config import ConfigError, EngineConfig
from tandem.engine.engine import Engine, StepResult
from tandem.engine.spec_decode import SpeculativeConfig
from tandem.models import load_model_config
from tests.factories import prompts_for, save_random_hf_model

K = 4


def spec(draft: Path | str, k: int = K) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def save_draft(path: Path, vocab_size: int = 512) -> None:
    """A smaller random model with the test target's vocabulary (other weights: it proposes other tokens)."""
    save_random_hf_model(path, vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_random_hf_model(target)
    save_draft(draft)
    return target, draft


def _prompts() -> list[list[int]]:
    pattern = prompts_for(512, [9])[0]
    return [pattern * 3, *prompts_for(512, [25, 3, 40])]


class Recorder:
    """Counts an engine's steps with tokens, proposals and acceptances."""

    def __init__(self, llm: LLM) -> None:
        self.results: list[StepResult] = []
        step = llm.engine.step

        def recording() -> StepResult:
            result = step()
            self.results.append(result)
            return result

        llm.engine.step = recording  # type: ignore[method-assign]

    @property
    def drafted(self) -> int:
        return sum(r.num_draft_tokens for r in self.results)

    @property
    def accepted(self) -> int:
        return sum(r.num_accepted_tokens for r in self.results)


def _check_freed(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.block_pool.check_integrity()
    assert engine.draft is not None and not engine.draft._states  # nothing left of finished requests


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SAMPLED = [
    GREEDY,
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, top_k=5, seed=12, ignore_eos=True),
]
IDS = ["greedy", "seeded-top-p", "seeded-top-k"]


def test_a_draft_equal_to_the_target_accepts_every_greedy_proposal(models: tuple[Path, Path]) -> None:
    target, _ = models
    plain = LLM(str(target), max_model_len=256, block_size=8)
    spec_llm = LLM(str(target), max_model_len=256, block_size=8, speculative_config=spec(target))
    recorder = Recorder(spec_llm)
    prompts = _prompts()
    got = spec_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert recorder.drafted > 0 and recorder.accepted == recorder.drafted  # acceptance 1.0
    # 40 tokens each: the prefill's, then K + 1 per step but where max_tokens cuts the last run short.
    decode_steps = [r for r in recorder.results if not r.is_prefill]
    assert len(decode_steps) <= 8
    _check_freed(spec_llm)


@pytest.mark.parametrize("params", SAMPLED, ids=IDS)
def test_another_draft_gives_the_tokens_of_decoding_one_at_a_time(models: tuple[Path, Path],
                                                                  params: SamplingParams) -> None:
    target, draft = models
    plain = LLM(str(target), max_model_len=256, block_size=8)
    spec_llm = LLM(str(target), max_model_len=256, block_size=8, speculative_config=spec(draft))
    recorder = Recorder(spec_llm)
    prompts = _prompts()
    assert [o.token_ids for o in spec_llm.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert recorder.drafted > 0
    _check_freed(spec_llm)


@pytest.mark.parametrize("same", [True, False], ids=["draft-is-target", "other-draft"])
def test_stop_token_and_max_tokens_mid_proposal(models: tuple[Path, Path], same: bool) -> None:
    target, draft = models
    plain = LLM(str(target), max_model_len=256, block_size=8)
    spec_llm = LLM(str(target), max_model_len=256, block_size=8,
                   speculative_config=spec(target if same else draft))
    prompts = _prompts()[:2]
    free = plain.generate(prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        for index in (3, 17):  # tokens produced mid-run
            stop = free[i].token_ids[index]
            params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
            expected = plain.generate([prompt], params)[0]
            got = spec_llm.generate([prompt], params)[0]
            assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
        for max_tokens in (1, 2, 3, 7, 13):
            limited = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            got = spec_llm.generate([prompt], limited)[0]
            assert (got.token_ids, got.finish_reason) == (free[i].token_ids[:max_tokens], "length")
    _check_freed(spec_llm)


def test_chunked_prefill_and_a_catch_up_over_several_rounds(models: tuple[Path, Path]) -> None:
    """A budget of 12 tokens: prompts are prefilled, and caught up by the draft, over several steps."""
    target, _ = models
    kwargs: dict[str, Any] = {"max_model_len": 256, "block_size": 8, "max_num_batched_tokens": 12}
    plain = LLM(str(target), **kwargs)
    spec_llm = LLM(str(target), speculative_config=spec(target), **kwargs)
    recorder = Recorder(spec_llm)
    prompts = [*prompts_for(512, [80, 45]), _prompts()[2]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in spec_llm.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert recorder.accepted == recorder.drafted > 0
    # Every prompt token once; a long catch-up gets the budget, the steady state (<= K + 1 a request) always runs.
    assert sum(r.num_draft_prompt_tokens for r in recorder.results) == sum(len(p) for p in prompts)
    assert max(r.num_draft_model_tokens for r in recorder.results) <= 12 + len(prompts) * (K + 1) + 3 * (K - 1)
    _check_freed(spec_llm)


def test_preemption_with_a_draft(models: tuple[Path, Path]) -> None:
    """16 blocks of 4 tokens for three requests growing to 50 tokens: some are preempted and recomputed (their
    draft state starts over); the tokens do not change."""
    target, draft = models
    kwargs: dict[str, Any] = {"max_model_len": 64, "max_num_batched_tokens": 128, "block_size": 4,
                              "num_kv_blocks": 16}
    plain = LLM(str(target), **kwargs)
    for other in (target, draft):
        spec_llm = LLM(str(target), speculative_config=spec(other), **kwargs)
        recorder = Recorder(spec_llm)
        prompts = prompts_for(512, [20, 20, 20])
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        assert [o.token_ids for o in spec_llm.generate(prompts, params)] == \
            [o.token_ids for o in plain.generate(prompts, params)]
        assert any(r.num_preemptions for result in recorder.results for r in result.requests)
        _check_freed(spec_llm)


def test_disaggregated_decode_computes_the_drafts_prompt_kv_itself(models: tuple[Path, Path]) -> None:
    """Prefill on one engine (no draft), pages written into a decode engine with a draft model: the draft computes
    the prompt on the decode side (counted), and the tokens are the colocated engine's."""
    target, draft = models
    config = EngineConfig.create(load_model_config(str(target)), max_model_len=128, block_size=8)
    speculative = SpeculativeConfig.from_dict(spec(target))
    prompt = prompts_for(512, [21])[0]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    colocated = Engine(config)
    expected = colocated.add_request("c", prompt, params)
    while colocated.has_unfinished():
        colocated.step()

    prefill, decode = Engine(config), Engine(config, speculative=speculative)
    sent = prefill.add_request("r", prompt, params, prefill_only=True)
    prefill.step()
    received = decode.add_request("r", prompt, params, remote_prefill=True)
    assert decode.step().reserved == [received]
    for layer in range(decode.layout.num_layers):
        decode.write_pages("r", layer, 0, *prefill.read_pages(sent, layer))
    decode.activate("r", sent.output_token_ids[0], sent.output_logprobs[0])
    results = []
    while decode.has_unfinished():
        results.append(decode.step())
    assert received.output_token_ids == expected.output_token_ids
    assert sum(r.num_draft_prompt_tokens for r in results) == len(prompt)
    assert sum(r.num_accepted_tokens for r in results) == sum(r.num_draft_tokens for r in results) > 0
    assert decode.num_free_blocks == decode.num_total_blocks


def _peaked_model(path: Path, vocab: int, scale: float, noise: float = 0.0) -> HFLlama:
    """A tiny random model over a small vocabulary with a sharpened head (distributions far from uniform); `noise`
    perturbs the head (a draft that agrees with the target only in part)."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = HFLlama(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        generator = torch.Generator().manual_seed(1)
        model.lm_head.weight.add_(noise * torch.randn(model.lm_head.weight.shape, generator=generator))
        model.model.layers[0].self_attn.q_proj.weight.mul_(8.0)
        model.model.layers[0].self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(path)
    return model


def _marginals(model: HFLlama, prompt: list[int], num_positions: int) -> list[torch.Tensor]:
    """The exact distribution of output tokens 0..num_positions-1 (temperature 1), by enumerating prefixes."""
    vocab = model.config.vocab_size
    prefixes = torch.tensor([prompt])  # [N, L]
    weights = torch.ones(1, dtype=torch.float64)  # probability of each prefix
    marginals = []
    with torch.no_grad():
        for _ in range(num_positions):
            probs = torch.softmax(model(prefixes).logits[:, -1].double(), dim=-1)  # [N, V]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(dim=0))
            weights = joint.reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab, dim=0),
                                  torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], dim=1)
    return marginals


def _chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.shape[0]).double()
    expected = probs * len(samples)
    keep = expected > 5  # pool the rare tokens into one cell
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    wanted = torch.cat([expected[keep], expected[~keep].sum()[None]])
    wanted_mask = wanted > 0
    return float(((observed - wanted)[wanted_mask] ** 2 / wanted[wanted_mask]).sum())


def test_unseeded_sampling_keeps_the_target_distribution(tmp_path: Path) -> None:
    """Unseeded requests at temperature 1: the proposals are rejection-sampled, so tokens differ from decoding one
    at a time with the same seeds but follow the same distribution. Output tokens 1..3 (those speculation
    produces) over 1,000 requests against the exact marginals of the target (HF, by enumeration), chi-square over
    at most 12 cells: 40 is exceeded by chance with probability ~1e-4. The draft's own distribution, as a
    control, is far off."""
    vocab, num_requests = 12, 1000
    target = _peaked_model(tmp_path / "target", vocab, scale=20.0)
    draft_model = _peaked_model(tmp_path / "draft", vocab, scale=20.0, noise=0.3)  # accepts ~40% of proposals
    prompt = [3, 7, 2, 9, 4]
    exact = _marginals(target, prompt, 4)
    draft_marginals = _marginals(draft_model, prompt, 4)
    spec_llm = LLM(str(tmp_path / "target"), max_model_len=32, block_size=4,
                   speculative_config=spec(tmp_path / "draft", 3))
    recorder = Recorder(spec_llm)
    outputs = spec_llm.generate([prompt] * num_requests,
                                SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
    assert 0.1 * recorder.drafted < recorder.accepted < 0.9 * recorder.drafted  # rejections and acceptances
    for position in (1, 2, 3):
        samples = [o.token_ids[position] for o in outputs]
        assert _chi_square(samples, exact[position]) < 40.0, position
        assert _chi_square(samples, draft_marginals[position]) > 200.0, position
    _check_freed(spec_llm)


def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused(models: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    target, _ = models
    with pytest.raises(ConfigError, match=r"^model: the draft model 'dummy:tiny' has a vocabulary of 49152"):
        LLM(str(target), max_model_len=64, speculative_config=spec("dummy:tiny", 2))
    save_random_hf_model(tmp_path, max_position_embeddings=32)
    with pytest.raises(ConfigError, match=r"^model: .* context of 32 tokens, below max_model_len \(64\)"):
        LLM(str(target), max_model_len=64, speculative_config=spec(tmp_path, 2))


@pytest.mark.slow
def test_smollm2_with_itself_as_draft_accepts_everything_and_honours_stop_strings(smollm2_path: Path) -> None:
    """SmolLM2 drafting for itself: every greedy proposal accepted, text identical, and a stop string that ends the
    reply mid-proposal cuts it where one-token-at-a-time decoding does."""
    messages = [{"role": "user", "content": "List the days of the week, one per line."}]
    plain = LLM(str(smollm2_path), max_model_len=512)
    free = plain.chat(messages, SamplingParams(max_tokens=40, temperature=0.0))[0]
    words = free.text.split()
    assert len(words) > 4
    stop = words[3]
    stopped = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
    expected = plain.chat(messages, stopped)[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < len(free.token_ids)

    same = LLM(str(smollm2_path), max_model_len=512, speculative_config=spec(smollm2_path))
    recorder = Recorder(same)
    got = same.chat(messages, SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert (got.token_ids, got.text) == (free.token_ids, free.text)
    assert recorder.accepted == recorder.drafted > 0
    got = same.chat(messages, stopped)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "stop")
    _check_freed(same)

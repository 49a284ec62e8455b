"""Speculative decoding without a model: config, n-gram proposals, verification, stop rules, rejection sampling.

Verification is checked against the sampler run one position at a time, and a whole generation loop with a toy
language model (a pure function of the last two tokens, so every logits row is bit-identical however it is
batched) shows speculative output equal to one-token-at-a-time output, greedy and seeded alike.
"""

from __future__ import annotations

import random
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
import torch

from tandem.common.config import ConfigError, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.ngram import NgramProposer
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import SamplingTensors, sample
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode import (
    SpeculativeConfig,
    pad_proposals,
    rejection_sample,
    truncate_at_stop,
    verify,
)

CPU = torch.device("cpu")


def make_request(seed: int = 0, num_outputs: int = 0, **kw: object) -> Request:
    r = Request(req_id=f"r{seed}", prompt_token_ids=[1], params=SamplingParams(**kw), seed=seed)  # type: ignore[arg-type]
    r.output_token_ids = [0] * num_outputs
    return r


# -- config ---------------------------------------------------------------------------------------------------

def test_config_accepts_vllms_dicts_and_resolves_ngram_bounds_as_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 2)
    defaults = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (defaults.prompt_lookup_min, defaults.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (only_max.method, only_max.prompt_lookup_min, only_max.prompt_lookup_max) == ("ngram", 4, 4)
    only_min = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    legacy = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3})
    assert legacy.method == "ngram" and legacy.model is None
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 5})
    assert (draft.method, draft.model, draft.prompt_lookup_max) == ("draft_model", "smollm2-135m", None)
    inferred = SpeculativeConfig.from_dict({"model": "dummy:tiny", "num_speculative_tokens": 2})
    assert inferred.method == "draft_model"
    with pytest.raises(FrozenInstanceError):
        c.num_speculative_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(("values", "field"), [
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "speculative_config"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": -1, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "smollm2-135m"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "4"}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_max": 3},
     "prompt_lookup_max"),
])
def test_config_rejects_bad_values_naming_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        SpeculativeConfig.from_dict(values)


def test_config_refuses_what_is_not_a_dict() -> None:
    with pytest.raises(ConfigError, match="^speculative_config"):
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]


# -- n-gram proposer ------------------------------------------------------------------------------------------

def reference_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one candidate at a time: longest n, then the latest earlier occurrence, then copy what
    followed it token by token (a copy that reaches the end reads the tokens it has just proposed)."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[length - n:]:
                extended = list(tokens)
                for j in range(k):
                    extended.append(extended[end + 1 + j])
                return extended[length:]
    return []


def test_ngram_proposes_what_followed_the_latest_occurrence() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    # "7 8" occurs twice before the end; the later one (followed by 4 5 6) wins.
    assert proposer.propose([[7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 9, 7, 8]]) == [[4, 5, 6]]
    # The longest suffix wins over a more recent shorter one: "2 7 8" only matches the first occurrence.
    assert proposer.propose([[2, 7, 8, 1, 1, 9, 7, 8, 4, 4, 2, 7, 8]]) == [[1, 1, 9]]


def test_ngram_without_match_or_below_min_n_proposes_nothing() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, min_n=2, max_n=3)
    assert proposer.propose([[1, 2, 3, 4, 5]]) == [[]]  # nothing repeats
    assert proposer.propose([[1, 9, 3, 4, 1]]) == [[]]  # only a 1-gram repeats
    assert proposer.propose([[1, 2, 5, 1, 2]]) == [[5, 1]]  # a 2-gram does
    assert proposer.propose([[], [4], [4, 4]]) == [[], [], []]  # too short for an earlier 2-gram
    assert NgramProposer(2, 1, 1).propose([[4, 4]]) == [[4, 4]]


def test_ngram_max_n_caps_the_match_so_a_recent_short_one_wins() -> None:
    tokens = [2, 7, 8, 1, 1, 9, 7, 8, 4, 4, 2, 7, 8]
    assert NgramProposer(3, min_n=1, max_n=2).propose([tokens]) == [[4, 4, 2]]
    assert NgramProposer(3, min_n=3, max_n=3).propose([tokens]) == [[1, 1, 9]]


def test_ngram_copy_past_the_end_extends_the_loop() -> None:
    proposer = NgramProposer(num_speculative_tokens=5, min_n=1, max_n=3)
    assert proposer.propose([[5, 5, 5, 5]]) == [[5, 5, 5, 5, 5]]  # period 1
    assert proposer.propose([[9, 1, 2, 3, 1, 2, 3]]) == [[1, 2, 3, 1, 2]]  # period 3, K = 5 > 3 left
    assert proposer.propose([[1, 2, 3, 4, 1, 2]]) == [[3, 4, 1, 2, 3]]


def test_ngram_batch_matches_the_definition_on_random_sequences() -> None:
    rng = random.Random(0)
    for k, min_n, max_n in [(1, 1, 1), (3, 1, 3), (4, 2, 4), (6, 2, 5)]:
        proposer = NgramProposer(k, min_n, max_n)
        batch = [[rng.randrange(3) for _ in range(rng.randrange(0, 30))] for _ in range(200)]
        expected = [reference_proposal(t, k, min_n, max_n) for t in batch]
        assert proposer.propose(batch) == expected
        assert [proposer.propose([t])[0] for t in batch[:20]] == expected[:20]


def test_ngram_padded_input_ignores_what_follows_each_row() -> None:
    proposer = NgramProposer(3, 1, 2)
    tokens = np.array([[1, 2, 9, 1, 2, 0, 1, 2], [3, 4, 3, 4, 3, 4, 9, 9]], dtype=np.int64)
    lengths = np.array([5, 4])
    assert proposer.propose_padded(tokens, lengths) == [[9, 1, 2], [3, 4, 3]]


# -- verification ---------------------------------------------------------------------------------------------

def one_at_a_time(logits: torch.Tensor, requests: list[Request]) -> tuple[list[list[int]], list[list[float]]]:
    """The target's token and logprob at every row, drawn by the plain sampler one row and position at a time."""
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for s, request in enumerate(requests):
        row_tokens, row_logprobs = [], []
        for j in range(logits.shape[1]):
            at_j = make_request(request.seed, request.num_output_tokens + j, **vars_of(request.params))
            token_id, logprob = sample(logits[s, j:j + 1], SamplingTensors.from_requests([at_j], CPU))
            row_tokens.append(int(token_id))
            row_logprobs.append(float(logprob))
        tokens.append(row_tokens)
        logprobs.append(row_logprobs)
    return tokens, logprobs


def vars_of(params: SamplingParams) -> dict[str, object]:
    return {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}


def expected_run(targets: list[int], proposal: list[int]) -> int:
    num_accepted = 0
    while num_accepted < len(proposal) and proposal[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return num_accepted


VERIFY_REQUESTS = [
    {"temperature": 0.0},
    {"temperature": 0.8},
    {"temperature": 1.3, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 0.6, "top_k": 4, "top_p": 0.9},
]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("params", [[VERIFY_REQUESTS[0]] * 6, VERIFY_REQUESTS + [VERIFY_REQUESTS[1]]])
def test_verify_equals_the_sampler_position_by_position(layout: str, params: list[dict[str, object]]) -> None:
    """All accepted, none accepted, partial runs and no proposals at all, greedy and seeded: the emitted tokens
    are the target's own at rows 0..num_accepted, accepted exactly while the proposals equal them."""
    torch.manual_seed(0)
    k, vocab = 4, 7
    requests = [make_request(seed=11 * s, num_outputs=3 * s, **p) for s, p in enumerate(params)]
    logits = torch.randn(len(requests), k + 1, vocab) * 2
    targets, target_logprobs = one_at_a_time(logits, requests)
    runs = [k, 0, 2, 4, 1, 3]  # accepted prefix length built into each request's proposal
    lengths = [4, 4, 3, 4, 2, 0]  # proposals per request (the last is a plain decode row)
    proposals: list[list[int]] = []
    for s, (run, length) in enumerate(zip(runs, lengths, strict=True)):
        run = min(run, length)
        wrong = [(t + 1 + s) % vocab for t in targets[s][run:length]]  # differs from the target at `run`
        proposals.append(targets[s][:run] + wrong)
    if layout == "packed":
        step_logits = torch.cat([logits[s, :len(p) + 1] for s, p in enumerate(proposals)])
    else:
        step_logits = logits
    out = verify(step_logits, pad_proposals(proposals, k, CPU), SamplingTensors.from_requests(requests, CPU))
    token_ids, logprobs = out.tolist()
    for s, proposal in enumerate(proposals):
        num_accepted = expected_run(targets[s], proposal)
        assert num_accepted == min(runs[s], lengths[s])
        assert int(out.num_accepted[s]) == num_accepted
        assert token_ids[s] == targets[s][:num_accepted + 1]
        assert logprobs[s] == pytest.approx(target_logprobs[s][:num_accepted + 1], abs=1e-6)
    assert out.token_ids.shape == (len(requests), k + 1)


def test_verify_of_a_batch_equals_each_request_alone() -> None:
    torch.manual_seed(1)
    k, vocab = 3, 6
    requests = [make_request(seed=s, num_outputs=s, **p) for s, p in enumerate(VERIFY_REQUESTS)]
    logits = torch.randn(len(requests), k + 1, vocab)
    proposals = torch.randint(0, vocab, (len(requests), k))
    together = verify(logits, proposals, SamplingTensors.from_requests(requests, CPU)).tolist()
    alone = [verify(logits[s:s + 1], proposals[s:s + 1], SamplingTensors.from_requests([r], CPU)).tolist()
             for s, r in enumerate(requests)]
    assert together[0] == [a[0][0] for a in alone]


# -- the whole loop with a toy language model -----------------------------------------------------------------

class ToyLM:
    """Next-token logits as a pure function of the last two tokens: a peaked random table, so generations
    fall into loops that the n-gram proposer can predict, and every row is exact however it is batched."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab * vocab, vocab, generator=g) * 3.0

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return self.table[tokens[-2] * self.vocab + tokens[-1]]


def stop_ids(request: Request, eos_ids: tuple[int, ...]) -> set[int]:
    return set(request.params.stop_token_ids) | (set() if request.params.ignore_eos else set(eos_ids))


def generate_one_at_a_time(lm: ToyLM, request: Request, scheduler: Scheduler) -> list[int]:
    scheduler.add(request)
    while request.status is not RequestStatus.RUNNING:
        scheduler.schedule()
    while not request.status.is_finished:
        tensors = SamplingTensors.from_requests([request], CPU)
        token_id, logprob = sample(lm.logits(request.all_token_ids)[None, :], tensors)
        scheduler.append_token(request, int(token_id), float(logprob))
    return request.output_token_ids


def generate_speculatively(lm: ToyLM, requests: list[Request], proposer: NgramProposer,
                           eos_ids: tuple[int, ...]) -> tuple[int, int]:
    """Verify steps over the whole batch until every request stops; returns (steps, tokens accepted)."""
    k = proposer.num_speculative_tokens
    running = list(requests)
    num_steps = num_accepted = 0
    while running:
        proposals = proposer.propose([r.all_token_ids for r in running])
        # As the scheduler would: never verify past max_tokens (the run emits k + 1 tokens at most).
        proposals = [p[:r.params.max_tokens - r.num_output_tokens - 1] for p, r in zip(proposals, running, strict=True)]
        rows = [lm.logits(r.all_token_ids + p[:j]) for r, p in zip(running, proposals, strict=True)
                for j in range(len(p) + 1)]
        out = verify(torch.stack(rows), pad_proposals(proposals, k, CPU), SamplingTensors.from_requests(running, CPU))
        token_ids, logprobs = out.tolist()
        num_steps += 1
        num_accepted += int(out.num_accepted.sum())
        for request, emitted, emitted_logprobs in zip(list(running), token_ids, logprobs, strict=True):
            num_kept, status = truncate_at_stop(emitted, request.num_output_tokens, request.params.max_tokens,
                                                stop_ids(request, eos_ids))
            request.output_token_ids += emitted[:num_kept]
            request.output_logprobs += emitted_logprobs[:num_kept]
            if status is not None:
                request.status = status
                running.remove(request)
    return num_steps, num_accepted


def test_speculative_generation_equals_one_token_at_a_time() -> None:
    vocab, eos = 6, (5,)
    lm = ToyLM(vocab, seed=3)
    params = [dict(temperature=0.0, max_tokens=60, ignore_eos=True),
              dict(temperature=0.0, max_tokens=40),
              dict(temperature=0.7, seed=1, max_tokens=60, ignore_eos=True),
              dict(temperature=1.0, top_k=2, seed=2, max_tokens=50, ignore_eos=True),
              dict(temperature=0.9, top_p=0.8, seed=3, max_tokens=45, stop_token_ids=[4]),
              dict(temperature=0.5, top_k=3, top_p=0.9, seed=4, max_tokens=33)]
    prompts = [[1, 2, 3, 1, 2], [0, 1], [2, 2, 3], [4, 0, 1, 4], [3, 1], [1, 0, 2, 1]]

    def make(i: int) -> Request:
        return Request(req_id=f"r{i}", prompt_token_ids=list(prompts[i]), params=SamplingParams(**params[i]),  # type: ignore[arg-type]
                       seed=1000 + i)

    scheduler = Scheduler(SchedulerConfig().resolved("cpu"), BlockPool(256), block_size=4, eos_token_ids=eos)
    references = [make(i) for i in range(len(params))]
    for reference in references:
        generate_one_at_a_time(lm, reference, scheduler)
    proposer = NgramProposer(num_speculative_tokens=4, min_n=1, max_n=3)
    requests = [make(i) for i in range(len(params))]
    num_steps, num_accepted = generate_speculatively(lm, requests, proposer, eos)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in references]
    for request, reference in zip(requests, references, strict=True):
        assert request.output_logprobs == pytest.approx(reference.output_logprobs, abs=1e-6)
    assert [r.status for r in requests] == [r.status for r in references]
    assert {r.status for r in references} == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH}
    # Speculation did happen: many proposals were accepted (108 of 183 tokens here), and the batch took fewer
    # steps than its longest request has tokens (29 against 60).
    assert num_accepted > sum(r.num_output_tokens for r in references) // 4
    assert num_steps < max(r.num_output_tokens for r in references) // 1.5


# -- stop rules inside a verified run -------------------------------------------------------------------------

def test_truncate_at_stop_equals_appending_one_token_at_a_time() -> None:
    rng = random.Random(0)
    eos = (2,)
    for _ in range(400):
        params = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(6), rng.randint(0, 2)))
        num_outputs = rng.randint(0, params.max_tokens - 1)
        run = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        # The reference: the scheduler's own rules, token by token, until the request finishes.
        scheduler = Scheduler(SchedulerConfig().resolved("cpu"), BlockPool(16), block_size=4, eos_token_ids=eos)
        request = Request(req_id="r", prompt_token_ids=[1], params=params, seed=0)
        scheduler.add(request)
        scheduler.schedule()
        request.output_token_ids = [9] * num_outputs  # 9 stops nothing
        kept = 0
        for token_id in run:
            scheduler.append_token(request, token_id, 0.0)
            kept += 1
            if request.status.is_finished:
                break
        status = request.status if request.status.is_finished else None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        assert truncate_at_stop(run, num_outputs, params.max_tokens, stops) == (kept, status)


# -- rejection sampling ---------------------------------------------------------------------------------------

def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of integer samples against probs, over the support (a sample outside it fails)."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() * samples.shape[0]
    return float(((counts[support] - expected) ** 2 / expected).sum())


def processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target distribution written out for the test: softmax(logits / T) over the top k."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k:
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, probs.topk(top_k, dim=-1).indices, True)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_rejection_sampling_emits_the_target_distribution(temperature: float, top_k: int) -> None:
    """Every emitted position follows the target distribution p_j, whatever the draft q_j proposed: the first
    token over all trials, the second where the first proposal was accepted, the bonus where both were.
    Chi-square over 5 tokens (4 degrees of freedom, or top_k - 1): 25 is exceeded by chance with probability
    below 1e-4. Forgetting the residual (drawing from p after a rejection) would score ~1800 on the first token
    here, and the draft's own proposals, checked as a control, score over 20000."""
    num_trials, k, vocab = 20_000, 2, 5
    target_logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0], [0.0, 1.5, 0.3, -1.0, 0.4], [0.5, 0.5, 1.2, -0.3, 0.1]])
    draft = torch.tensor([[0.1, 0.4, 0.3, 0.1, 0.1], [0.4, 0.1, 0.1, 0.2, 0.2]])
    generator = torch.Generator().manual_seed(0)
    proposals = torch.stack([torch.multinomial(draft[j], num_trials, replacement=True, generator=generator)
                             for j in range(k)], dim=1)  # [N, K]
    tensors = SamplingTensors(
        temperatures=torch.full((num_trials,), temperature), top_ks=torch.full((num_trials,), top_k),
        top_ps=torch.ones(num_trials), seeds=torch.arange(num_trials), positions=torch.full((num_trials,), 7),
        any_top_k=top_k > 0, any_top_p=False)
    logits = target_logits.expand(num_trials, k + 1, vocab)
    out = rejection_sample(logits, proposals, draft.expand(num_trials, k, vocab), tensors)
    p = processed(target_logits, temperature, top_k)
    num_accepted = out.num_accepted
    threshold = 25.0 if top_k == 0 else 20.0  # 3 degrees of freedom: P(> 20) ~ 2e-4
    assert chi_square(out.token_ids[:, 0], p[0]) < threshold
    assert chi_square(out.token_ids[num_accepted >= 1, 1], p[1]) < threshold
    assert chi_square(out.token_ids[num_accepted == 2, 2], p[2]) < threshold
    assert (num_accepted >= 1).sum() > 3000 and (num_accepted == 2).sum() > 1000  # enough samples per test
    assert chi_square(proposals[:, 0], draft[0]) < 25.0  # the control is a fair sample of q...
    assert chi_square(proposals[:, 0][p[0][proposals[:, 0]] > 0], p[0]) > 200.0  # ...which is far from p


def test_rejection_sampling_is_exact_match_for_greedy_rows_and_reproducible() -> None:
    torch.manual_seed(2)
    k, vocab = 3, 6
    logits = torch.randn(4, k + 1, vocab)
    argmax = logits.argmax(dim=-1)
    proposals = torch.stack([argmax[0, :k], torch.tensor([argmax[1, 0].item(), (argmax[1, 1].item() + 1) % vocab, 0]),
                             torch.randint(0, vocab, (k,)), torch.full((k,), -1)])
    draft = torch.softmax(torch.randn(4, k, vocab), dim=-1)
    requests = [make_request(0, temperature=0.0), make_request(1, temperature=0.0), make_request(2, temperature=0.9),
                make_request(3, num_outputs=5, temperature=0.8, top_k=4)]
    out = rejection_sample(logits, proposals, draft, SamplingTensors.from_requests(requests, CPU))
    token_ids = out.tolist()[0]
    exact = verify(logits[:2], proposals[:2], None)
    assert token_ids[:2] == exact.tolist()[0]
    assert out.num_accepted[:2].tolist() == [3, 1]
    # No proposals: the plain sampler's token.
    assert token_ids[3] == sample(logits[3, :1], SamplingTensors.from_requests(requests[3:], CPU))[0].tolist()
    # The same seed and proposals give the same tokens, in any batch.
    again = rejection_sample(logits[2:3], proposals[2:3], draft[2:3], SamplingTensors.from_requests(requests[2:3], CPU))
    assert again.tolist()[0][0] == token_ids[2]
    assert rejection_sample(logits[:2], proposals[:2], draft[:2], None).tolist() == exact.tolist()

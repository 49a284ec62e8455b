"""The batched sampler: greedy, truncation, and placement-free seeded randomness."""

from __future__ import annotations

import torch

from tandem.common.sampling_params import SamplingParams
from tandem.engine.request import Request
from tandem.engine.sampler import SamplingTensors, sample, splitmix64, uniform_noise


def request(seed: int = 0, num_outputs: int = 0, **kw: object) -> Request:
    r = Request(req_id="r", prompt_token_ids=[1], params=SamplingParams(**kw), seed=seed)  # type: ignore[arg-type]
    r.output_token_ids = [0] * num_outputs
    return r


def draw(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    token_ids, _ = sample(logits, SamplingTensors.from_requests(requests, logits.device))
    return token_ids.tolist()


def test_splitmix64_matches_the_reference_values() -> None:
    # First outputs of the splitmix64 generator seeded with 0 (state += golden gamma, then mix).
    golden = 0x9E3779B97F4A7C15
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    states = torch.tensor([golden * 0, (golden * 1) & (2**64 - 1)], dtype=torch.uint64).to(torch.int64)
    got = [v & (2**64 - 1) for v in splitmix64(states).tolist()]
    assert got == expected


def test_noise_is_uniform_and_keyed_by_seed_and_position() -> None:
    seeds = torch.tensor([1, 1, 2], dtype=torch.int64)
    positions = torch.tensor([0, 1, 0], dtype=torch.int64)
    u = uniform_noise(seeds, positions, 50_000)
    assert ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(seeds[:1], positions[:1], 50_000)
    assert torch.equal(again[0], u[0])


def test_greedy_rows_take_the_argmax_and_report_its_logprob() -> None:
    logits = torch.randn(3, 100)
    token_ids, logprobs = sample(logits, SamplingTensors.from_requests(
        [request(temperature=0.0), request(temperature=0.0), request(temperature=0.0)], logits.device))
    assert token_ids.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_seeded_rows_reproduce_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    requests = [request(seed=7, num_outputs=3), request(seed=8), request(temperature=0.0), request(seed=9)]
    together = draw(logits, requests)
    alone = [draw(logits[i:i + 1], [requests[i]])[0] for i in range(4)]
    assert together == alone
    reordered = draw(logits[[3, 0]], [requests[3], requests[0]])
    assert reordered == [together[3], together[0]]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(3000, 1)
    requests = [request(seed=s) for s in range(3000)]
    counts = torch.bincount(torch.tensor(draw(logits, requests)), minlength=3).float() / 3000
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_top_k_and_top_p_never_emit_excluded_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 64).repeat(500, 1)
    order = logits[0].argsort(descending=True)
    top3 = set(order[:3].tolist())
    picked = draw(logits, [request(seed=s, top_k=3, temperature=2.0) for s in range(500)])
    assert set(picked) <= top3 and len(set(picked)) == 3
    probs = torch.softmax(logits[0], -1)[order]
    # The nucleus: the smallest prefix (in probability order) whose mass reaches top_p.
    top_p = 0.5
    size = int((probs.cumsum(0) < top_p).sum().item()) + 1
    nucleus = set(order[:size].tolist())
    picked = draw(logits, [request(seed=s, top_p=top_p) for s in range(500)])
    assert set(picked) <= nucleus and len(set(picked)) > 1

"""The fused greedy sampler (`tandem.kernels.greedy_sample`) against torch's `max` and `logsumexp`: the same token
(the first maximum on ties), the same logprob to fp32 rounding, at batch 1 with a Llama-3-sized vocabulary split into
many parts, at larger batches, with ties across tiles and parts, and with -inf logits.

Run: `TRITON_INTERPRET=1 pytest tests/kernels/test_greedy_sample.py` (kernels through the interpreter on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.greedy_sample import BLOCK_V, greedy_parts, greedy_sample_ref, greedy_sample_triton


def test_greedy_parts_cover_the_vocabulary() -> None:
    for rows, vocab in ((1, 128256), (1, 49152), (64, 128256), (256, 128256), (3, 100), (1, 1), (600, 5000)):
        parts, per_part = greedy_parts(rows, vocab)
        assert per_part % BLOCK_V == 0 and parts >= 1
        assert (parts - 1) * per_part < vocab <= parts * per_part  # every part holds at least one entry
    assert greedy_parts(1, 128256)[0] > 100  # a single row is spread over the GPU


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (4, 49152), (9, 3000), (2, 17)])
def test_matches_max_and_logsumexp(rows: int, vocab: int, device: torch.device) -> None:
    logits = torch.randn(rows, vocab, device=device) * 4
    ids, logprobs, lse = greedy_sample_triton(logits)
    ref_ids, ref_logprobs, ref_lse = greedy_sample_ref(logits)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
def test_ties_go_to_the_first_index(device: torch.device) -> None:
    vocab = 5 * BLOCK_V + 7
    logits = torch.randn(3, vocab, device=device)
    # row 0: the maximum twice in one tile; row 1: in two tiles; row 2: in the last and the first part
    for row, cols in ((0, (10, 11)), (1, (BLOCK_V + 3, 3 * BLOCK_V)), (2, (vocab - 1, 2))):
        for col in cols:
            logits[row, col] = 50.0
    ids, logprobs, _ = greedy_sample_triton(logits)
    assert ids.tolist() == [10, BLOCK_V + 3, 2]
    torch.testing.assert_close(logprobs, greedy_sample_ref(logits)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
def test_minus_infinity_counts_nothing(device: torch.device) -> None:
    logits = torch.randn(2, 3 * BLOCK_V, device=device)
    logits[0, : 2 * BLOCK_V] = float("-inf")  # whole tiles (and parts) masked out
    logits[1, 1::2] = float("-inf")
    ids, logprobs, _ = greedy_sample_triton(logits)
    ref_ids, ref_logprobs, _ = greedy_sample_ref(logits)
    assert torch.equal(ids, ref_ids) and torch.isfinite(logprobs).all()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
def test_rejects_other_dtypes(device: torch.device) -> None:
    with pytest.raises(ValueError, match="float32"):
        greedy_sample_triton(torch.randn(2, 8, device=device, dtype=torch.float64))
    ids, logprobs, _ = greedy_sample_triton(torch.empty(0, 8, device=device))
    assert ids.shape == (0,) and logprobs.shape == (0,)

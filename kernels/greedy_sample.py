"""Greedy sampling's two reductions over the vocabulary in one read: each row's first maximum (the token) and its
logprob (max - logsumexp), for logits [S, V] float32.

Why: torch's `max(dim=-1)` and `logsumexp` read the logits twice with their own reduce kernels, and at batch 1 a
single 128k-wide row gives those kernels little parallelism: on an H100 they took ~55 us per decode step of the 8B
model (28 + 13 + 14 us, `benchmarks/results/h100-2026-12-07c/1-pdl/profile*.txt`), against a 512 KB read.

Here the grid is (rows, parts): each program scans one slice of its row in tiles with an online max and a running
sum of exp(x - max), keeping the first index of the maximum; a second kernel (one program per row) merges the
parts in order, so ties go to the lowest index as `torch.max` does on CUDA (and `argmax`). The logprob comes out as
-log(sum_p s_p * exp(m_p - M)): the same value as `max - logsumexp` to fp32 rounding.
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, tl, triton

BLOCK_V = 1024  # one tile: 4 KB of fp32 logits per step of a program's loop
_TARGET_PROGRAMS = 512  # parts enough to spread a single row over an H100 / H200's 132 SMs


@triton.jit
def _greedy_parts_kernel(
    logits_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr,
    V, stride_row, per_part, num_parts,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * per_part
    end = tl.minimum(start + per_part, V)
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    for tile in range(start, end, BLOCK_V):
        cols = tile + offs
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < end, other=float("-inf"))
        tile_max = tl.max(x, axis=0)
        tile_idx = tile + tl.argmax(x, axis=0, tie_break_left=True)
        new_best = tl.maximum(best, tile_max)
        # (-inf logits, as a masked vocabulary has, count nothing: while every logit so far is -inf, subtract 0
        # rather than -inf, whose difference with itself would be NaN)
        shift = tl.where(new_best > float("-inf"), new_best, 0.0)
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
        best_idx = tl.where(tile_max > best, tile_idx, best_idx)  # strictly: an earlier equal maximum stays
        best = new_best
    out = row * num_parts + part
    tl.store(part_max_ptr + out, best)
    tl.store(part_idx_ptr + out, best_idx)
    tl.store(part_sum_ptr + out, total)


@triton.jit
def _greedy_merge_kernel(
    part_max_ptr, part_idx_ptr, part_sum_ptr, ids_ptr, logprobs_ptr, lse_ptr,
    num_parts,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_P)
    mask = parts < num_parts
    maxes = tl.load(part_max_ptr + row * num_parts + parts, mask=mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row * num_parts + parts, mask=mask, other=0.0)
    best = tl.max(maxes, axis=0)
    first = tl.argmax(maxes, axis=0, tie_break_left=True)  # parts are in vocabulary order: the first maximum
    total = tl.sum(tl.where(mask, sums * tl.exp(maxes - best), 0.0), axis=0)
    tl.store(ids_ptr + row, tl.load(part_idx_ptr + row * num_parts + first).to(tl.int64))
    tl.store(logprobs_ptr + row, -tl.log(total))
    tl.store(lse_ptr + row, best + tl.log(total))


def greedy_parts(num_rows: int, vocab_size: int) -> tuple[int, int]:
    """(parts per row, vocabulary entries per part): whole tiles per part, ~_TARGET_PROGRAMS programs in all, at
    least one tile each. A pure function of the shape."""
    tiles = triton.cdiv(vocab_size, BLOCK_V)
    parts = max(1, min(tiles, _TARGET_PROGRAMS // max(num_rows, 1)))
    per_part = triton.cdiv(tiles, parts) * BLOCK_V
    return triton.cdiv(vocab_size, per_part), per_part


def greedy_sample_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 -> (the first maximum's index [S] int64, its logprob [S] float32 = max - logsumexp,
    the row's logsumexp [S] float32: the normalizer of any other token's logprob)."""
    check_launchable("greedy_sample", logits)
    check_last_dim_contiguous("greedy_sample", logits=logits)
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"greedy_sample: logits must be 2-D float32 [S, V], got {tuple(logits.shape)} {logits.dtype}")
    num_rows, vocab_size = logits.shape
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return ids, logprobs, lse
    if vocab_size == 0:
        raise ValueError("greedy_sample: an empty vocabulary has no maximum")
    num_parts, per_part = greedy_parts(num_rows, vocab_size)
    part_max = torch.empty((num_rows, num_parts), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((num_rows, num_parts), dtype=torch.int32, device=logits.device)
    part_sum = torch.empty((num_rows, num_parts), dtype=torch.float32, device=logits.device)
    _greedy_parts_kernel[(num_rows, num_parts)](
        logits, part_max, part_idx, part_sum, vocab_size, logits.stride(0), per_part, num_parts,
        BLOCK_V=BLOCK_V, num_warps=4,
    )
    _greedy_merge_kernel[(num_rows,)](
        part_max, part_idx, part_sum, ids, logprobs, lse, num_parts,
        BLOCK_P=max(triton.next_power_of_2(num_parts), 16), num_warps=1,
    )
    return ids, logprobs, lse


def greedy_sample_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in torch (what the sampler ran before): `max` and `logsumexp`."""
    best, ids = logits.max(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return ids, best - lse, lse

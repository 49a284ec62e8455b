"""Batched sampling on the logits' device, with placement-free randomness.

Every random draw is a pure function of (request seed, output position, vocabulary index): a
splitmix64 hash computed with int64 tensor ops. So a seeded request yields the same tokens alone or
in any batch, on the prefill worker (first token) or the decode worker (the rest), and when replayed
on another worker after a failure. Sampling is an exponential race (equivalently Gumbel-max):
argmax_i p_i / E_i with E_i = -log(U_i) picks i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.request import Request
from tandem.kernels import _triton
from tandem.kernels.greedy_sample import greedy_sample_ref, greedy_sample_triton

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors; multiplication wraps modulo 2^64 as in C."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0, 1) draws [S, V], float32, keyed by (seed [S], output position [S], vocabulary index)."""
    row_keys = splitmix64(splitmix64(seeds) ^ positions)  # [S]
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = splitmix64(row_keys[:, None] + vocab[None, :])  # [S, V]
    # The top 24 bits fill a float32 mantissa exactly; +0.5 keeps U strictly inside (0, 1).
    return (_shr(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """One step's per-row parameters, moved to the device in one go."""

    temperatures: torch.Tensor  # [S] float32 (0 = greedy)
    top_ks: torch.Tensor  # [S] int64 (0 = off)
    top_ps: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64: index of the output token being drawn
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_requests(cls, requests: list[Request], device: torch.device, num_unapplied: int = 0
                      ) -> SamplingTensors | None:
        """The step's parameters on the device; None when every request is greedy (the common serving
        case), which needs none of them: no host→device copies at all. `num_unapplied`: output tokens each
        request has that the host has not appended yet (async scheduling), counted in the draw's position."""
        params = [r.params for r in requests]
        temperatures = [p.temperature for p in params]
        if all(t == 0.0 for t in temperatures):
            return None
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32).to(device, non_blocking=True),
            top_ks=torch.tensor(top_ks, dtype=torch.int64).to(device, non_blocking=True),
            top_ps=torch.tensor(top_ps, dtype=torch.float32).to(device, non_blocking=True),
            seeds=torch.tensor([_signed(r.seed) for r in requests], dtype=torch.int64).to(
                device, non_blocking=True),
            positions=torch.tensor([r.num_output_tokens + num_unapplied for r in requests], dtype=torch.int64).to(
                device, non_blocking=True),
            any_top_k=any(k > 0 for k in top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
        )


def greedy_reductions(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 → (first maximum [S] int64, its logprob [S], logsumexp [S]): the fused Triton kernel on a
    GPU (one read of the logits; torch's two reductions took ~55 µs of an 8B batch-1 step on an H100), torch
    elsewhere."""
    if logits.is_cuda and _triton.HAS_TRITON and logits.dtype == torch.float32 and logits.is_contiguous():
        return greedy_sample_triton(logits)
    return greedy_sample_ref(logits)


def sample(logits: torch.Tensor, tensors: SamplingTensors | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 → (token ids [S] int64, logprobs [S] float32); `tensors` None: all greedy.

    The logprob is the chosen token's under the model's raw distribution (before temperature and
    truncation), as vLLM reports by default: its logit less the row's logsumexp, which reads the logits
    once and writes no [S, V] log-softmax.
    """
    # The first maximum on ties, as argmax; on a GPU one read of the logits for both reductions.
    greedy_ids, greedy_logprobs, log_normalizer = greedy_reductions(logits)
    if tensors is None:
        return greedy_ids, greedy_logprobs
    is_greedy = tensors.temperatures == 0.0
    temperatures = torch.where(is_greedy, 1.0, tensors.temperatures)
    scaled = logits / temperatures[:, None]
    if tensors.any_top_k or tensors.any_top_p:
        scaled = _truncate(scaled, tensors)
    probs = torch.softmax(scaled, dim=-1)
    noise = uniform_noise(tensors.seeds, tensors.positions, logits.shape[-1])
    # Exponential race: p / E with E = -log(U) ~ Exp(1); excluded tokens have p = 0 and never win.
    sampled_ids = (probs / -torch.log(noise)).argmax(dim=-1)
    token_ids = torch.where(is_greedy, greedy_ids, sampled_ids)
    return token_ids, logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizer


def _truncate(scaled: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Mask to -inf every token outside the top-k and outside the top-p nucleus of its row."""
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    vocab_size = scaled.shape[-1]
    rank = torch.arange(vocab_size, device=scaled.device)[None, :]  # [1, V]
    top_ks = torch.where(tensors.top_ks > 0, tensors.top_ks, vocab_size)
    drop = rank >= top_ks[:, None]  # [S, V] in sorted order
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass strictly
    # before it already reaches top_p. The first token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= tensors.top_ps[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, sorted_ids, sorted_logits)

"""Rotary position embedding tables, including Llama-3's frequency scaling."""

from __future__ import annotations

import math

import torch

from tandem.common.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), rescaled per Llama-3 when rope_type is "llama3"."""
    # float32 throughout, as HF computes it: the tables then match the reference bit for bit.
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "llama3":
        low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half, sin in the second (float32)."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)

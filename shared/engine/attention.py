"""Per-step attention metadata, built by the runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    # Flat KV slot of each new token (block_id * block_size + offset); -1 skips (graph padding).
    slot_mapping: torch.Tensor  # [T] int64
    # Prefill: packed prompts, sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1].
    cu_seqlens: torch.Tensor | None = None  # [B+1] int32
    max_seqlen: int = 0
    # Decode: one query per sequence over its paged context.
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [B] int32
    num_splits: int | None = None

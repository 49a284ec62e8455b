"""Per-step attention metadata, built by the runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KVLayer = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


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
    # Prefill role: other pools the new tokens' K/V are also stored into as each layer runs (a decode worker's
    # pool on the same GPU): (that pool's per-layer caches, a slot per token of this step, -1 where a token
    # does not go there).
    kv_mirrors: list[tuple[list[KVLayer], torch.Tensor]] = field(default_factory=list)

"""Per-step attention metadata, built by the runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KVLayer = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


@dataclass
class AttentionMetadata:
    """A step's tokens are packed decode tokens first, then prompt chunks. The first `num_decode_tokens` (one per
    decoding sequence) attend through the paged decode kernel; the rest, if any (`is_prefill`), through a prefill
    kernel: among their own tokens when every chunk starts at position 0, else over the paged cache."""

    is_prefill: bool
    # Flat KV slot of each new token (block_id * block_size + offset); -1 skips (graph padding).
    slot_mapping: torch.Tensor  # [T] int64
    # Prompt chunks: chunk i is tokens num_decode_tokens + cu_seqlens[i] : ... + cu_seqlens[i+1].
    cu_seqlens: torch.Tensor | None = None  # [B+1] int32
    max_seqlen: int = 0
    # Chunks with context (not all at position 0): each one's whole length (context + new tokens) and pages; the
    # new tokens then read every key from the paged cache. None: they attend among their own new tokens.
    seq_lens: torch.Tensor | None = None  # [B] int32
    prefill_block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    # Decode tokens: how many lead the step (all of a pure decode step's), and their sequences' pages.
    num_decode_tokens: int = 0
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [S] int32
    num_splits: int | None = None
    # Prefill role: other pools the new tokens' K/V are also stored into as each layer runs (a decode worker's
    # pool on the same GPU): (that pool's per-layer caches, a slot per token of this step, -1 where a token
    # does not go there).
    kv_mirrors: list[tuple[list[KVLayer], torch.Tensor]] = field(default_factory=list)

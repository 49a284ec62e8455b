"""Names for full KV blocks, so that a block computed once can serve every prompt that starts the same way.

A block's hash covers its own tokens and, through its parent's hash, every token before it, plus an extra key
(the model and KV-layout fingerprint, a LoRA id): two blocks with equal hashes hold equal K/V.

Why sha256 and not Python's `hash()`: `hash()` of str and bytes is salted per process (PYTHONHASHSEED), so a
prefill worker, a decode worker and a router would each name the same block differently; and it is 64 bits
with no collision resistance, while a collision here means a request silently attends to another prompt's K/V
(vLLM's CVE-2025-25183 was crafted collisions of exactly this kind). The full 32-byte digest is kept: truncating
it saved nothing measurable (a 32k-token prompt hashes in ~2 ms on the 2-core CPU either way).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

# 32 bytes of sha256: compact, hashable as a dict key, equal in every process.
BlockHash = bytes

# The parent of a sequence's first block. Versioned: a change of the encoding below must change it.
ROOT_HASH: BlockHash = hashlib.sha256(b"tandem.prefix_cache.v1").digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: str | bytes = b"",
                 parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, in order; a trailing partial block gets none.

    hash_i = sha256(hash_{i-1} ‖ len(extra_key) ‖ extra_key ‖ block i's tokens as little-endian int64), with
    hash_{-1} = `parent`, or ROOT_HASH when None (the sequence's start). Every field has a fixed or prefixed
    length, so no two inputs encode alike. To extend a chain as a sequence grows, pass the tokens from the first
    block not yet hashed (they must start at a block boundary) and the last hash as `parent`.
    """
    assert block_size > 0, f"block_size must be positive, got {block_size}"
    if isinstance(extra_key, str):
        extra_key = extra_key.encode()
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    key_field = len(extra_key).to_bytes(8, "little") + extra_key
    # One pack for the whole sequence, then a bytes slice per block: ~4x cheaper than packing per block.
    data = struct.pack(f"<{num_full * block_size}q", *token_ids[:num_full * block_size])
    step = 8 * block_size
    sha256 = hashlib.sha256
    last = ROOT_HASH if parent is None else parent
    hashes: list[BlockHash] = []
    for start in range(0, num_full * step, step):
        last = sha256(last + key_field + data[start:start + step]).digest()
        hashes.append(last)
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens as vLLM counts them: per lookup, the request's tokens (queries) and
    those found cached (hits); hit rate = hits / queries. Also the cached blocks evicted to make room."""

    num_lookups: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

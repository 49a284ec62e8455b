"""The KV block pool: a free list and reference counts, in pure Python (no tensors here)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out fixed-size KV blocks by id. Blocks are allocated on demand and freed at once."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, f"num_blocks must be positive, got {num_blocks}"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), f"asked for {num_blocks} blocks, {len(self._free)} free"
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_integrity(self) -> None:
        """Every block is either free (ref count 0, listed once) or held; raises AssertionError if not."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: ref count {count}, free={block_id in free}"

"""The KV block pool: a free list, reference counts and the prefix cache, in pure Python (no tensors here)."""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import compress

from tandem.common.prefix_cache import BlockHash, PrefixCacheStats


class BlockPool:
    """Hands out fixed-size KV blocks by id, and keeps full blocks' K/V for reuse under their hash.

    Every block is in exactly one state:
    - free, uncached: on the free list, handed out first;
    - free, cached ("evictable"): ref count 0, findable by hash, in LRU order; counted as free, and handed out
      (its hash dropped) only when no uncached block is left, least recently used first;
    - held: ref count > 0 (the number of requests using it), cached or not; never handed out nor evicted.

    A caller that never calls `cache_full_block` sees the plain pool: allocate, free, nothing cached.

    Admission with the cache: `ids = find_cached(hashes)` (the longest cached prefix), check
    `can_allocate(num_new, ids)`, then `acquire(ids)` *before* `allocate(num_new)` (allocating first could
    evict the hits). Register each block with `cache_full_block` once it is full and its K/V computed; `free`
    the whole block table when the request ends or is preempted: its cached blocks stay findable.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, f"num_blocks must be positive, got {num_blocks}"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free and uncached
        self._ref_counts = [0] * num_blocks
        # The prefix cache: hash -> block, its reverse, and the evictable blocks, least recently used first.
        self._cached: dict[BlockHash, int] = {}
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache_stats = PrefixCacheStats()

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: the uncached free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, held or evictable."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- allocation -----------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Whether `num_blocks` new blocks can be allocated after acquiring `cached_block_ids` (the hits of
        `find_cached`: those that are evictable leave the free count when acquired)."""
        num_taken = sum(1 for block_id in cached_block_ids if self._ref_counts[block_id] == 0)
        return num_blocks + num_taken <= len(self._free) + len(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks, each with ref count 1: uncached free blocks first, then the least recently used
        evictable ones, whose hashes are dropped (their K/V will be overwritten)."""
        free = self._free
        if num_blocks <= len(free):
            block_ids = [free.popleft() for _ in range(num_blocks)]
        else:
            assert num_blocks <= len(free) + len(self._evictable), \
                f"asked for {num_blocks} blocks, {len(free) + len(self._evictable)} free"
            block_ids = list(free)
            free.clear()
            block_ids += [self._evict() for _ in range(num_blocks - len(block_ids))]
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def _evict(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._block_hashes[block_id]
        assert block_hash is not None, f"evictable block {block_id} has no hash"
        del self._cached[block_hash]
        self._block_hashes[block_id] = None
        self.prefix_cache_stats.num_evicted_blocks += 1
        return block_id

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. A block no one holds returns to the free list, or, if cached,
        becomes evictable as the most recently used; pass a request's block table in order: its later blocks
        are evicted before its earlier ones (a block is useless to a lookup once its parent is gone)."""
        ref_counts = self._ref_counts
        block_hashes = self._block_hashes
        now_evictable: list[int] = []
        for block_id in block_ids:
            count = ref_counts[block_id]
            assert count > 0, f"block {block_id} freed twice"
            ref_counts[block_id] = count - 1
            if count == 1:
                if block_hashes[block_id] is None:
                    self._free.append(block_id)
                else:
                    now_evictable.append(block_id)
        if now_evictable:
            evictable = self._evictable
            for block_id in reversed(now_evictable):
                evictable[block_id] = None

    # -- the prefix cache -----------------------------------------------------------------------
    def find_cached(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest prefix of `block_hashes` that is cached (held or evictable), in order;
        they become the most recently used. Acquires nothing: call `acquire` on the ones you use."""
        cached = self._cached
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        self.touch(block_ids)
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Make the evictable ones among `block_ids` the most recently used, earlier blocks the most recent."""
        evictable = self._evictable
        for block_id in reversed(block_ids):
            if block_id in evictable:
                evictable.move_to_end(block_id)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block: a cached hit (taken out of the evictable ones if no one held it), or a
        block already held (shared). A free uncached block holds nothing worth sharing: `allocate` it."""
        ref_counts = self._ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                assert self._block_hashes[block_id] is not None, \
                    f"block {block_id} is free and uncached: allocate it, do not acquire it"
                del self._evictable[block_id]
            ref_counts[block_id] += 1

    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> int:
        """Register a held block, once it is full and its K/V computed, under its hash; returns the block that
        the cache keeps for the hash.

        That is `block_id`, unless another block already holds the hash (two requests computed the same prefix
        in the same step): then the first stays cached and `block_id` stays an uncached duplicate, which goes
        back to the free list when freed, ahead of every cached block. The caller may switch to the returned
        block (`acquire` it, `free` its own) once no step in flight reads its own. Registering a block again
        under the same hash does nothing; under another hash is a bug (AssertionError).
        """
        assert self._ref_counts[block_id] > 0, f"block {block_id} is not held: only computed K/V can be cached"
        current = self._block_hashes[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} is already cached under another hash"
            return block_id
        first = self._cached.setdefault(block_hash, block_id)
        if first == block_id:
            self._block_hashes[block_id] = block_hash
        return first

    def cached_hash_prefixes(self, max_blocks: int) -> bytes:
        """What the cache holds, compactly, for routers: the first 8 bytes of each cached block's hash (held or
        evictable), concatenated. All of them when at most `max_blocks` are cached; otherwise the held ones (in
        use now), then the evictable ones, most recently used first, `max_blocks` in all.

        Read-only, and safe to call from another thread than the pool's owner: each structure it reads is copied
        by one C-level call that runs no Python code, so under the GIL it is never seen mid-change. The copies
        may be a step apart (a block evicted in between may still be listed): a routing hint tolerates that, and
        nothing here raises on it.
        """
        assert max_blocks >= 0, f"max_blocks must be >= 0, got {max_blocks}"
        hashes = list(self._cached)  # insertion order: the snapshot is all that is read from here on
        if len(hashes) > max_blocks:
            block_hashes = self._block_hashes[:]
            ref_counts = self._ref_counts[:]
            lru = list(self._evictable)
            held = [h for h in compress(block_hashes, ref_counts) if h is not None]  # ref count > 0
            evictable = [h for h in map(block_hashes.__getitem__, reversed(lru)) if h is not None]
            hashes = (held + evictable)[:max_blocks]
        # 32-byte hashes, joined, viewed as 8-byte words: every 4th word is a hash's first 8 bytes (the words are
        # read and written back in the same byte order, so the bytes come out as they were).
        words = array("Q", b"".join(hashes))
        assert words.itemsize == 8 and len(words) == 4 * len(hashes), "block hashes are 32-byte sha256 digests"
        return words[::4].tobytes()

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup as vLLM does: the request's tokens, and those it found cached."""
        assert 0 <= num_hit_tokens <= num_query_tokens, (num_hit_tokens, num_query_tokens)
        stats = self.prefix_cache_stats
        stats.num_lookups += 1
        stats.num_query_tokens += num_query_tokens
        stats.num_hit_tokens += num_hit_tokens

    def reset_cache(self) -> int:
        """Forget every hash (new weights, a cold benchmark): evictable blocks become plain free blocks, held ones
        stay held, uncached. Returns the number of hashes dropped."""
        num_dropped = len(self._cached)
        for block_id in self._evictable:
            self._free.append(block_id)
        self._evictable.clear()
        self._cached.clear()
        self._block_hashes = [None] * self.num_blocks
        return num_dropped

    # -- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block is exactly one of free-uncached (on the free list once), free-cached (evictable, in the LRU)
        or held (ref count > 0); the hash map and its reverse agree. Raises AssertionError if not."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        evictable = set(self._evictable)
        assert not free & evictable, f"blocks {sorted(free & evictable)} are both free and evictable"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            block_hash = self._block_hashes[block_id]
            state = "held" if count > 0 else "free" if block_hash is None else "evictable"
            assert (block_id in free) == (state == "free"), \
                f"block {block_id}: ref count {count}, cached={block_hash is not None}, on free list={block_id in free}"
            assert (block_id in evictable) == (state == "evictable"), \
                f"block {block_id}: ref count {count}, cached={block_hash is not None}, in LRU={block_id in evictable}"
            if block_hash is not None:
                assert self._cached.get(block_hash) == block_id, \
                    f"block {block_id}'s hash maps to block {self._cached.get(block_hash)}"
        num_hashed = sum(h is not None for h in self._block_hashes)
        assert num_hashed == len(self._cached), f"{len(self._cached)} hashes cached, {num_hashed} blocks hashed"

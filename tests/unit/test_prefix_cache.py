"""The prefix cache: block hashes, and the block pool's cached blocks (sharing, LRU eviction, integrity)."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.common.prefix_cache import ROOT_HASH, BlockHash, block_hashes
from tandem.engine.block_pool import BlockPool

BLOCK = 4


def h(i: int) -> BlockHash:
    """A stand-in block hash: the pool only compares them."""
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


# -- hashing -----------------------------------------------------------------------------------------
def test_block_hashes_cover_full_blocks_only_and_follow_the_documented_encoding() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, BLOCK, "m")
    assert len(hashes) == 2 and block_hashes(tokens[:3], BLOCK, "m") == []
    first = hashlib.sha256(ROOT_HASH + (1).to_bytes(8, "little") + b"m" + struct.pack("<4q", 0, 1, 2, 3)).digest()
    second = hashlib.sha256(first + (1).to_bytes(8, "little") + b"m" + struct.pack("<4q", 4, 5, 6, 7)).digest()
    assert hashes == [first, second]
    assert all(isinstance(x, bytes) and len(x) == 32 for x in hashes)


def test_same_block_tokens_under_different_prefixes_hash_differently() -> None:
    shared_block = [7, 7, 7, 7]
    a = block_hashes([1, 2, 3, 4] + shared_block, BLOCK)
    b = block_hashes([1, 2, 3, 5] + shared_block, BLOCK)
    assert a[0] != b[0] and a[1] != b[1]
    # Equal prefixes name equal blocks, whatever follows them.
    assert block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BLOCK)[0] == a[0]


def test_extra_key_block_size_and_token_width_change_hashes() -> None:
    tokens = list(range(8))
    assert set(block_hashes(tokens, BLOCK, "model-a")).isdisjoint(block_hashes(tokens, BLOCK, "model-b"))
    assert block_hashes(tokens, BLOCK, "") != block_hashes(tokens, BLOCK, "x")
    assert block_hashes(tokens, BLOCK, "k") == block_hashes(tokens, BLOCK, b"k")  # str is its UTF-8
    assert block_hashes(tokens, 8)[0] not in block_hashes(tokens, BLOCK)
    # Tokens are 8-byte fields: a large id is not two small ones.
    assert block_hashes([2**32, 0, 0, 0], BLOCK) != block_hashes([0, 1, 0, 0], BLOCK)


def test_parent_continues_a_chain() -> None:
    tokens = list(range(100, 130))
    whole = block_hashes(tokens, BLOCK, "m")
    head = block_hashes(tokens[:12], BLOCK, "m")
    assert head + block_hashes(tokens[12:], BLOCK, "m", parent=head[-1]) == whole


def test_hashes_are_stable_across_processes_and_hash_seeds() -> None:
    expected = "63b755a5c12c161f99ac3f86b55a7ab02b3dae9b0ab2a86218a8b8cbb5c153d6"
    assert block_hashes(list(range(16)), 16, "model-a")[0].hex() == expected
    code = ("from tandem.common.prefix_cache import block_hashes;"
            "print(block_hashes(list(range(16)), 16, 'model-a')[0].hex())")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == expected


# -- the pool without the cache ------------------------------------------------------------------------
def test_uncached_pool_behaves_as_a_plain_free_list() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free([1, 0])
    assert pool.allocate(4) == [2, 3, 1, 0]  # freed blocks go to the back, in the order freed
    assert pool.num_free_blocks == 0 and not pool.can_allocate(1)
    pool.free([0, 1, 2, 3])
    pool.check_integrity()
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 0
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([0])


# -- the pool with the cache -----------------------------------------------------------------------------
def cache_table(pool: BlockPool, hashes: list[BlockHash]) -> list[int]:
    """A request's blocks, computed and registered."""
    block_ids = pool.allocate(len(hashes))
    for block_id, block_hash in zip(block_ids, hashes, strict=True):
        assert pool.cache_full_block(block_id, block_hash) == block_id
    return block_ids


def test_freed_cached_blocks_stay_findable_and_count_as_free() -> None:
    pool = BlockPool(6)
    table = cache_table(pool, [h(0), h(1), h(2)])
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 3
    pool.free(table)
    pool.check_integrity()
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3 and pool.num_evictable_blocks == 3
    assert pool.find_cached([h(0), h(1), h(9), h(2)]) == table[:2]  # the longest cached prefix only
    assert pool.find_cached([h(1)]) == [table[1]] and pool.find_cached([h(9)]) == []


def test_allocate_takes_uncached_blocks_first_then_least_recently_used() -> None:
    pool = BlockPool(6)
    old = cache_table(pool, [h(0), h(1)])
    new = cache_table(pool, [h(10), h(11)])
    pool.free(old)
    pool.free(new)
    # Uncached blocks first (4, 5), then the LRU: old's table, its last block before its first.
    assert pool.allocate(2) == [4, 5] and pool.num_cached_blocks == 4
    assert pool.allocate(1) == [old[1]]
    assert pool.find_cached([h(0), h(1)]) == [old[0]]  # h(1) is gone; h(0) is now the most recent
    assert pool.allocate(2) == [new[1], new[0]]
    assert pool.allocate(1) == [old[0]]
    assert pool.num_cached_blocks == 0 and pool.prefix_cache_stats.num_evicted_blocks == 4
    pool.check_integrity()


def test_touch_and_lookup_make_blocks_most_recent() -> None:
    pool = BlockPool(4)
    a = cache_table(pool, [h(0), h(1)])
    b = cache_table(pool, [h(2), h(3)])
    pool.free(a)
    pool.free(b)
    pool.touch([a[1]])
    pool.find_cached([h(0)])
    assert pool.allocate(4) == [b[1], b[0], a[1], a[0]]
    assert pool.num_cached_blocks == 0  # evicting dropped every hash


def test_a_found_chain_is_evicted_from_its_end() -> None:
    pool = BlockPool(4)
    a = cache_table(pool, [h(0), h(1)])
    b = cache_table(pool, [h(2), h(3)])
    pool.free(a)
    pool.free(b)  # LRU: a1, a0, b1, b0
    assert pool.find_cached([h(0), h(1)]) == a  # a becomes the most recent, its first block last of all
    assert pool.allocate(4) == [b[1], b[0], a[1], a[0]]


def test_shared_block_ref_counts() -> None:
    pool = BlockPool(4)
    table = cache_table(pool, [h(0), h(1)])
    hits = pool.find_cached([h(0), h(1)])
    assert hits == table
    pool.acquire(hits)
    assert [pool.ref_count(b) for b in table] == [2, 2]
    pool.free(table)  # the first request ends; the second still holds both blocks
    assert [pool.ref_count(b) for b in table] == [1, 1] and pool.num_evictable_blocks == 0
    assert pool.num_free_blocks == 2 and pool.allocate(2) == [2, 3]
    pool.free(hits)
    assert pool.num_evictable_blocks == 2
    pool.acquire(pool.find_cached([h(0)]))  # an evictable hit leaves the free count
    assert pool.num_free_blocks == 1 and pool.num_evictable_blocks == 1 and pool.ref_count(table[0]) == 1
    pool.check_integrity()


def test_eviction_never_touches_held_blocks() -> None:
    pool = BlockPool(5)
    held = cache_table(pool, [h(0), h(1)])
    gone = cache_table(pool, [h(2)])
    pool.free(gone)
    assert pool.allocate(3) == [3, 4, gone[0]]
    assert not pool.can_allocate(1)
    with pytest.raises(AssertionError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    assert pool.find_cached([h(0), h(1)]) == held and pool.find_cached([h(2)]) == []


def test_can_allocate_counts_evictable_hits_as_taken() -> None:
    pool = BlockPool(4)
    table = cache_table(pool, [h(0), h(1)])
    pool.free(table)
    hits = pool.find_cached([h(0), h(1)])
    assert pool.can_allocate(2, hits) and not pool.can_allocate(3, hits) and pool.can_allocate(4)
    pool.acquire(hits[:1])
    assert pool.can_allocate(2, hits) and not pool.can_allocate(3, hits)  # the held hit takes nothing more


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    first, duplicate = pool.allocate(2)
    assert pool.cache_full_block(first, h(0)) == first
    assert pool.cache_full_block(duplicate, h(0)) == first  # noticed: the caller learns the cached block
    assert pool.cache_full_block(first, h(0)) == first  # again, same hash: nothing changes
    assert pool.num_cached_blocks == 1 and pool.find_cached([h(0)]) == [first]
    with pytest.raises(AssertionError, match="already cached under another hash"):
        pool.cache_full_block(first, h(1))
    # The duplicate is plain: freed, it is handed out before any cached block.
    pool.free([first, duplicate])
    assert pool.allocate(3) == [2, 3, duplicate]
    assert pool.find_cached([h(0)]) == [first]
    pool.check_integrity()


def test_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(AssertionError, match="not held"):
        pool.cache_full_block(0, h(0))
    with pytest.raises(AssertionError, match="free and uncached"):
        pool.acquire([0])
    pool.check_integrity()


def test_stats_and_reset() -> None:
    pool = BlockPool(4)
    table = cache_table(pool, [h(0), h(1)])
    pool.record_lookup(num_query_tokens=10, num_hit_tokens=8)
    pool.record_lookup(num_query_tokens=10, num_hit_tokens=0)
    stats = pool.prefix_cache_stats
    assert (stats.num_lookups, stats.num_query_tokens, stats.num_hit_tokens, stats.hit_rate) == (2, 20, 8, 0.4)
    pool.free(table[1:])
    assert pool.reset_cache() == 2
    pool.check_integrity()
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 3 and pool.find_cached([h(0)]) == []
    pool.free(table[:1])
    assert pool.num_free_blocks == 4 and pool.num_evictable_blocks == 0


def test_check_integrity_catches_a_broken_map() -> None:
    pool = BlockPool(3)
    table = cache_table(pool, [h(0)])
    pool._cached[h(0)] = 2  # a corrupt map: the hash points to another block
    with pytest.raises(AssertionError, match="maps to block 2"):
        pool.check_integrity()
    pool._cached[h(0)] = table[0]
    pool.free(table)
    pool._free.append(table[0])  # and an evictable block on the free list too
    with pytest.raises(AssertionError, match="both free and evictable"):
        pool.check_integrity()


# -- stateful: the pool against an obviously correct model ------------------------------------------------
class ModelPool:
    """The pool's contract written the slow, plain way: lists searched and spliced."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.hash: list[BlockHash | None] = [None] * num_blocks
        self.free_list = list(range(num_blocks))
        self.lru: list[int] = []  # least recently used first

    def owner(self, block_hash: BlockHash) -> int | None:
        return next((b for b, x in enumerate(self.hash) if x == block_hash), None)

    def allocate(self, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            if self.free_list:
                ids.append(self.free_list.pop(0))
            else:
                block_id = self.lru.pop(0)
                self.hash[block_id] = None
                ids.append(block_id)
        for block_id in ids:
            self.ref[block_id] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        newly: list[int] = []
        for block_id in ids:
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                (self.free_list if self.hash[block_id] is None else newly).append(block_id)
        self.lru += newly[::-1]

    def find(self, hashes: list[BlockHash]) -> list[int]:
        ids = []
        for block_hash in hashes:
            block_id = self.owner(block_hash)
            if block_id is None:
                break
            ids.append(block_id)
        self.touch(ids)
        return ids

    def touch(self, ids: list[int]) -> None:
        for block_id in reversed(ids):
            if block_id in self.lru:
                self.lru.remove(block_id)
                self.lru.append(block_id)

    def acquire(self, ids: list[int]) -> None:
        for block_id in ids:
            if self.ref[block_id] == 0:
                self.lru.remove(block_id)
            self.ref[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> int:
        if self.hash[block_id] is not None:
            return block_id
        owner = self.owner(block_hash)
        if owner is not None:
            return owner
        self.hash[block_id] = block_hash
        return block_id


HASHES = [h(i) for i in range(6)]  # a small universe: hits, chains and duplicates are common


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / acquire-cached / cache / free / evict-by-allocating against the model. Each held list
    is one request's references."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(1)
        self.model = ModelPool(1)
        self.tables: list[list[int]] = []

    @initialize(num_blocks=st.integers(1, 10))
    def make_pool(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.model = ModelPool(num_blocks)

    def held(self) -> set[int]:
        return {b for table in self.tables for b in table}

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """Up to every free block: past the uncached ones, this evicts."""
        n = data.draw(st.integers(0, self.pool.num_free_blocks), label="n")
        held_before = self.held()
        num_evicted = self.pool.prefix_cache_stats.num_evicted_blocks
        ids = self.pool.allocate(n)
        if self.pool.prefix_cache_stats.num_evicted_blocks > num_evicted:
            event("allocate evicted cached blocks")
        assert not held_before & set(ids), f"allocate returned held blocks {held_before & set(ids)}"
        assert ids == self.model.allocate(n)
        self.tables.append(ids)

    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=4), use=st.booleans())
    def acquire_cached(self, hashes: list[BlockHash], use: bool) -> None:
        hits = self.pool.find_cached(hashes)
        assert hits == self.model.find(hashes)
        if any(self.pool.ref_count(b) > 0 for b in hits) and use:
            event("a held block shared")
        if use:
            self.pool.acquire(hits)
            self.model.acquire(hits)
            self.tables.append(hits)

    @precondition(lambda self: any(self.tables))
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def cache(self, data: st.DataObject, block_hash: BlockHash) -> None:
        table = data.draw(st.sampled_from([t for t in self.tables if t]), label="table")
        block_id = data.draw(st.sampled_from(table), label="block")
        if self.model.hash[block_id] not in (None, block_hash):
            with pytest.raises(AssertionError, match="another hash"):
                self.pool.cache_full_block(block_id, block_hash)
            return
        cached_as = self.pool.cache_full_block(block_id, block_hash)
        assert cached_as == self.model.cache(block_id, block_hash)
        if cached_as != block_id:
            event("duplicate hash: the first block kept")

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1), label="table"))
        self.pool.free(table)
        self.model.free(table)

    @rule(block_id=st.integers(0, 9))
    def touch(self, block_id: int) -> None:
        if block_id < self.pool.num_blocks:
            self.pool.touch([block_id])
            self.model.touch([block_id])

    @invariant()
    def pool_is_whole_and_matches_the_model(self) -> None:
        self.pool.check_integrity()
        model = self.model
        assert [self.pool.ref_count(b) for b in range(self.pool.num_blocks)] == model.ref
        assert self.pool.num_free_blocks == len(model.free_list) + len(model.lru)
        assert self.pool.num_evictable_blocks == len(model.lru)
        assert self.pool.num_cached_blocks == sum(x is not None for x in model.hash)
        references: dict[int, int] = {}
        for table in self.tables:
            for block_id in table:
                references[block_id] = references.get(block_id, 0) + 1
        assert all(self.pool.ref_count(b) == n for b, n in references.items())


PoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_pool_state_machine = PoolMachine.TestCase

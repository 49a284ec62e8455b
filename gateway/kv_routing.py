"""KV-aware routing: the decode (and prefill) worker for a request, by its cached prefix weighed against load.

Each worker publishes what its prefix cache holds (`CacheSummary`: the first 8 bytes of every cached block's
hash, at most ~0.5 s old here, see `tandem.serving.registry`). The gateway hashes a prompt once, as the workers
name their blocks (`tandem.common.prefix_cache.block_hashes` under the worker's block size and hash key), and for
each candidate counts `matched`: the longest run of the prompt's leading blocks in its view of the worker, which
is the published summary plus this gateway's own placements since. A request routed to W will leave its blocks
on W, and the next request sharing that prefix must see so at once, not half a second later; a placement stays
in the view until a summary lists its blocks, or for `placement_ttl_s` (a summary taken before the request's
blocks were computed does not list them yet, and dropping the placement then would scatter the very requests
it is for). The same holds for load: a request placed on W counts against W until W's next record.

Cost, in KV blocks, lowest wins (ties at random, so equal workers share the traffic):

    cost(W)     = prefill_weight × (prompt blocks − matched(W)) − headroom(W)
    headroom(W) = (free blocks − blocks placed since W's record) / (1 + queued requests + requests placed since)

The first term is what W would compute and ship for this request. Headroom is the load measure routing used before
prefix caching (`pick_pair`: free blocks per queued request), with this gateway's placements counted at once: a
placed request counts as queued until W reports on it, so a burst that shares a prefix spreads over the workers
instead of following the first placement. Between workers of equal pools and no queue, the headroom difference is
the difference of their blocks in use, so the trade is Dynamo's (prefill blocks saved against KV blocks in use),
while a larger pool or a shorter queue still counts as room. When no candidate holds more than `min_match_share`
of the prompt's blocks the match is noise: the most headroom wins. The prefill worker is chosen the same way among
those with the decode worker's fingerprint.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.common.errors import UnavailableError
from tandem.common.prefix_cache import block_hashes
from tandem.serving.registry import CacheSummary, WorkerRecord, prefix_of

# Prompt blocks hashed inline at most (~2 µs each on the 2-core CPU): past this, off the event loop.
OFFLOAD_BLOCKS = 1024
# How many candidates the `route` span lists (the cheapest first).
NUM_TRACED_CANDIDATES = 4
# The block size a worker that publishes no summary is taken to have (CacheConfig's default), to count its load.
UNKNOWN_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVRoutingConfig:
    """How the gateway weighs cached blocks against load."""

    # What one prompt block to compute (and ship) costs against one block of headroom. A prefill block is computed
    # once; a block in use is read by every decode step of its request. On an H200 (Llama-3.1-8B, blocks of 16)
    # computing a block takes ~0.38 ms (1,024 tokens in 24 ms) and reading one more block at every step of a
    # 256-token reply ~0.11 ms (2 MiB at ~4.8 TB/s, 256 times): a ratio of ~3.4. 2 stays below it because those
    # reads slow every request of the batch, and a fuller pool is closer to queueing and preemption. A judgment,
    # not a measurement of serving: `benchmarks/prefix_chat.py` is where to tune it.
    prefill_weight: float = 2.0
    # Below this share of the prompt's blocks cached anywhere, route by load alone.
    min_match_share: float = 0.1
    # Longest a placement counts if no summary ever lists its blocks (the request failed, or was evicted).
    placement_ttl_s: float = 10.0
    # Placed block hashes remembered per worker, at most (the oldest are forgotten first).
    max_pending_blocks: int = 65536

    def __post_init__(self) -> None:
        if self.prefill_weight < 0 or not 0 <= self.min_match_share <= 1:
            raise ValueError(f"prefill_weight must be >= 0 and min_match_share in [0, 1], got "
                             f"{self.prefill_weight} and {self.min_match_share}")
        if self.placement_ttl_s <= 0 or self.max_pending_blocks < 0:
            raise ValueError(f"placement_ttl_s must be > 0 and max_pending_blocks >= 0, got "
                             f"{self.placement_ttl_s} and {self.max_pending_blocks}")


class PromptBlocks:
    """A prompt's block hashes (as summary prefixes), computed once per (block size, hash key) and kept for all
    of the request's routing attempts."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._prefixes: dict[tuple[int, bytes], list[int]] = {}

    def keys_needed(self, workers: Sequence[WorkerRecord]) -> set[tuple[int, bytes]]:
        """The (block size, hash key) pairs of `workers`' summaries not hashed yet."""
        return {(w.cache.block_size, w.cache.hash_key) for w in workers
                if w.cache is not None and (w.cache.block_size, w.cache.hash_key) not in self._prefixes}

    def num_hashed_blocks(self, keys: set[tuple[int, bytes]]) -> int:
        return sum(len(self.token_ids) // block_size for block_size, _ in keys)

    def hash(self, keys: set[tuple[int, bytes]]) -> None:
        """Hash the full blocks under each key (any thread: it only adds entries)."""
        for block_size, hash_key in keys:
            hashes = block_hashes(self.token_ids, block_size, hash_key)
            self._prefixes[block_size, hash_key] = [prefix_of(h) for h in hashes]

    def prefixes(self, worker: WorkerRecord) -> list[int]:
        """The prompt's full blocks as `worker`'s summary would list them ([] if it publishes none)."""
        if worker.cache is None:
            return []
        key = (worker.cache.block_size, worker.cache.hash_key)
        if key not in self._prefixes:  # a worker that appeared after the request was hashed: rare, and small
            self.hash({key})
        return self._prefixes[key]

    def num_lookup_blocks(self, worker: WorkerRecord) -> int:
        """Blocks `worker` would look up in its cache (it always computes at least the prompt's last token)."""
        return (len(self.token_ids) - 1) // _block_size(worker)


@dataclass
class _WorkerView:
    """One worker as this gateway routes by it, beyond its record: its own placements not yet reflected."""

    summary: CacheSummary | None = None  # the last one seen (by identity: a new one prunes `pending`)
    # Placed blocks no summary has listed yet: prefix -> when placed (time.time()), oldest first.
    pending: dict[int, float] = field(default_factory=dict)
    # Requests placed since the worker's last record: (when placed, prompt tokens).
    placed: list[tuple[float, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    """A worker's score for one request."""

    worker: WorkerRecord
    matched_blocks: int
    headroom: float
    cost: float


@dataclass(frozen=True)
class Choice:
    """The worker picked in one pool, why, and how the candidates scored (cheapest first)."""

    worker: WorkerRecord
    matched_blocks: int
    prompt_blocks: int
    is_cache_aware: bool
    reason: str
    candidates: list[Candidate]


class KVRouter:
    """Scores workers for a request (`choose`), and remembers where this gateway placed requests (`place`)."""

    def __init__(self, config: KVRoutingConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or KVRoutingConfig()
        self._rng = rng or random.Random()
        self._views: dict[str, _WorkerView] = {}

    # -- scoring --------------------------------------------------------------------------------------------
    def matched_blocks(self, worker: WorkerRecord, prompt: PromptBlocks) -> int:
        """The prompt's leading blocks that `worker` holds, as far as this gateway knows."""
        cache = worker.cache
        if cache is None:
            return 0
        view = self._view(worker)
        published = cache.prefixes
        pending = view.pending
        oldest = time.time() - self.config.placement_ttl_s
        matched = 0
        for prefix in prompt.prefixes(worker)[:prompt.num_lookup_blocks(worker)]:
            if prefix not in published and pending.get(prefix, oldest) <= oldest:
                break
            matched += 1
        return matched

    def headroom(self, worker: WorkerRecord) -> float:
        """Free blocks per queued request, this gateway's placements since the worker's record counted in."""
        view = self._view(worker)
        block_size = _block_size(worker)
        placed_blocks = sum(-(-num_tokens // block_size) for _, num_tokens in view.placed)
        return (worker.num_free_blocks - placed_blocks) / (1 + worker.queue_depth + len(view.placed))

    def choose(self, workers: Sequence[WorkerRecord], prompt: PromptBlocks, pool: str) -> Choice:
        """The cheapest of `workers` for `prompt` (not empty), or the least loaded when no match is worth it."""
        assert workers, "choose needs at least one candidate"
        scored = []
        for worker in workers:
            num_blocks = prompt.num_lookup_blocks(worker)
            matched = self.matched_blocks(worker, prompt)
            headroom = self.headroom(worker)
            scored.append(Candidate(worker, matched, headroom,
                                    self.config.prefill_weight * (num_blocks - matched) - headroom))
        prompt_blocks = max(prompt.num_lookup_blocks(w) for w in workers)
        best_match = max(c.matched_blocks for c in scored)
        is_cache_aware = best_match > 0 and best_match >= self.config.min_match_share * prompt_blocks
        def key(c: Candidate) -> float:
            return c.cost if is_cache_aware else -c.headroom

        lowest = min(key(c) for c in scored)
        chosen = self._rng.choice([c for c in scored if key(c) == lowest])
        scored.sort(key=key)
        if is_cache_aware:
            reason = (f"cache-aware: {chosen.matched_blocks}/{prompt_blocks} prompt blocks cached there, lowest "
                      f"cost of {len(scored)} {pool} workers ({self.config.prefill_weight:g} x blocks to compute "
                      f"- headroom)")
        elif not any(w.cache is not None for w in workers):
            reason = (f"least loaded of {len(scored)} {pool} workers (most free blocks per queued request): none "
                      f"publishes its prefix cache")
        else:
            reason = (f"least loaded of {len(scored)} {pool} workers (most free blocks per queued request): the best "
                      f"holds {best_match}/{prompt_blocks} prompt blocks, under {self.config.min_match_share:.0%}")
        return Choice(chosen.worker, chosen.matched_blocks, prompt_blocks, is_cache_aware, reason, scored)

    def choose_pair(self, prefills: Sequence[WorkerRecord], decodes: Sequence[WorkerRecord],
                    prompt: PromptBlocks) -> tuple[Choice | None, Choice]:
        """The decode worker, then the prefill worker among those of its fingerprint (None: decode prefills
        locally). Raises UnavailableError when no decode worker is up."""
        if not decodes:
            raise UnavailableError("no decode worker is up")
        decode = self.choose(decodes, prompt, "decode")
        compatible = [p for p in prefills if p.fingerprint == decode.worker.fingerprint]
        prefill = self.choose(compatible, prompt, "prefill") if compatible else None
        return prefill, decode

    # -- this gateway's own placements ----------------------------------------------------------------------
    def place(self, worker: WorkerRecord, prompt: PromptBlocks) -> None:
        """Count a request routed to `worker` at once: its blocks will be cached there, and it takes room."""
        view = self._view(worker)
        view.placed.append((time.time(), len(prompt.token_ids)))
        if worker.cache is None or self.config.max_pending_blocks == 0:
            return
        now = time.time()
        pending = view.pending
        for prefix in prompt.prefixes(worker):
            pending.pop(prefix, None)  # re-inserted last: the dict stays ordered oldest first
            pending[prefix] = now
        excess = len(pending) - self.config.max_pending_blocks
        if excess > 0:
            for prefix in list(pending)[:excess]:
                del pending[prefix]

    def _view(self, worker: WorkerRecord) -> _WorkerView:
        """The worker's view, brought up to date with its record: placements its record or summary now reflects
        are dropped."""
        view = self._views.get(worker.address)
        if view is None:
            view = self._views[worker.address] = _WorkerView(summary=worker.cache)
        oldest = time.time() - self.config.placement_ttl_s
        # A request counts as load until a record taken after it was placed (or, from a registry that never
        # refreshes, for the placement's lifetime).
        since = max(worker.updated_at, oldest)
        if view.placed and view.placed[0][0] <= since:
            view.placed = [(t, n) for t, n in view.placed if t > since]
        if worker.cache is not view.summary:
            view.summary = worker.cache
            published = worker.cache.prefixes if worker.cache is not None else frozenset()
            view.pending = {p: t for p, t in view.pending.items() if t > oldest and p not in published}
        return view


def _block_size(worker: WorkerRecord) -> int:
    return worker.cache.block_size if worker.cache is not None else UNKNOWN_BLOCK_SIZE

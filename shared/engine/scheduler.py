"""Continuous batching with chunked prefill: decode tokens first, then prompt chunks up to a token budget.

Each step gives every scheduled request a number of new tokens to compute (its KV is then in the cache):
one for a request that is decoding, a chunk of its prompt for one that is prefilling (a long prompt takes
several steps). The step's token budget (`max_num_batched_tokens`) is filled by the running requests first,
in order, then by waiting requests admitted first come, first served (a later request never overtakes the
head of the queue). A request samples a token in the step that computes its last pending token. Blocks are
allocated as the tokens that need them are scheduled; when a running request cannot grow, the newest running
request is preempted by recompute (its blocks are freed and it goes back to the front of the queue).

Without chunked prefill a prompt is scheduled whole or not at all (the budget must then hold a whole prompt).

A step that carries decode tokens computes at most `prompt_tokens_while_decoding` prompt tokens while the queue is
short (the stall-free batching of Sarathi-Serve: the decoding requests' inter-token latency stays near a decode
step's), and the whole budget once more prompt tokens wait than BACKLOG_STEPS such steps would clear (throughput
first when the queue builds).

Step sizes: on a GPU a step with prompt tokens replays graphs captured for a few token counts, padded up to the next
(`step_sizes`, set by the engine from the runner). When the step's last chunk stops short of its prompt's end anyway,
it is trimmed to end the step on such a size if that drops fewer tokens than the padding would waste: they are
computed next step instead of padding rows now. That arithmetic (`fit_step_size`), a chunk's share of the budget
over a long context (`chunk_limit`) and the step's record (`SchedulerOutput`) live in `step_plan.py`.

Prefix caching: on admission a request's full blocks are looked up by hash in the block pool; the cached prefix
is shared (reference counted) and not computed again (its tokens count as computed), and every block that fills
up with computed K/V is registered under its hash for later requests. At least the last token is always
computed (its logits give the next token).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from tandem.common.config import BACKLOG_STEPS, SchedulerConfig
from tandem.common.prefix_cache import BlockHash, block_hashes
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request, RequestStatus
from tandem.engine.step_plan import SchedulerOutput, chunk_limit, fit_step_size, num_blocks_for


class Scheduler:
    """Owns the queues. `schedule()` picks the next step; `update_from_output()` applies its tokens."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int,
                 eos_token_ids: tuple[int, ...], prefix_key: bytes | None = None) -> None:
        """`prefix_key`: what else the cached K/V depend on (the model and KV layout fingerprint); None turns the
        prefix cache off."""
        assert config.max_num_batched_tokens is not None, "resolve the token budget first (SchedulerConfig.resolved)"
        self.config = config
        self.prefix_key = prefix_key
        self.block_pool = block_pool
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest (preempted first)
        # Decode role: requests whose pages a remote prefill worker is writing.
        self.receiving: dict[str, Request] = {}
        # Prefill role: prefilled requests whose blocks are held until their pages are exported.
        self.prefilled: dict[str, Request] = {}
        # Token counts a step with prompt tokens runs without padding (ascending; empty: any count, as on the CPU).
        self.step_sizes: tuple[int, ...] = ()
        # An experiment (benchmarks/sched_sim.py): the prompt cap is also lifted once a prompt not yet computed has
        # waited this long since its arrival (0: off); `clock` is what arrival times are read against.
        self.cap_max_wait_s = 0.0
        self.cap_lift = 0  # what a lifted cap allows (0: the whole budget)
        self.clock: Callable[[], float] = time.monotonic
        # Decode role: full prompt blocks of reserved requests whose pages have not landed, by hash -> (block, owner).
        # A later reservation shares them after its cached hits, so its prefix is neither computed nor shipped
        # again; it activates only after their owners.
        self.pending: dict[BlockHash, tuple[int, str]] = {}

    # -- queues -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission (for blocks, a batch slot or the token budget)."""
        return len(self.waiting)

    # -- remote prefill (decode role) ----------------------------------------------------------
    def activate(self, request: Request) -> None:
        """The pages have landed and the first token is known: the request joins the running batch (and its full
        blocks, now computed, join the prefix cache). Not before every request it waits for (`waits_for`)."""
        assert not request.waits_for and not request.shared_prefix_failed, "activated before the blocks it shares"
        self._drop_pending(request)
        del self.receiving[request.req_id]
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_prefill_tokens = request.num_tokens
        self.running.append(request)
        self._cache_blocks(request)

    def prefill_locally(self, request: Request, reason: str) -> None:
        """A reserved request whose transfer failed: free its blocks and compute its prompt here, first in line
        (it was admitted before everything still waiting). Those sharing its blocks fail with it."""
        del self.receiving[request.req_id]
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_registered_blocks = 0
        request.remote_prefill = False
        request.local_prefill_reason = reason
        request.status = RequestStatus.WAITING
        request.waits_for.clear()
        request.landed = None
        request.shared_prefix_failed = False
        self.waiting.appendleft(request)
        self.withdraw(request)

    def released_by(self, request: Request) -> list[Request]:
        """After `request` activated: those sharing its blocks that waited only for it, their own pages landed
        (activate them next, with `landed`)."""
        ready = []
        for req_id in request.dependents:
            dependent = self.receiving.get(req_id)
            if dependent is None or request.req_id not in dependent.waits_for:
                continue
            dependent.waits_for.discard(request.req_id)
            if not dependent.waits_for and dependent.landed is not None and not dependent.shared_prefix_failed:
                ready.append(dependent)
        request.dependents = []
        return ready

    def withdraw(self, request: Request) -> None:
        """A reserved request's transfer is failing (its writer may still be stopping): nobody new shares its
        blocks, and those sharing them fail over now (see `_fail_dependents`)."""
        self._drop_pending(request)
        self._fail_dependents(request)

    def _fail_dependents(self, request: Request) -> None:
        """`request` will not deliver the blocks others share (its transfer failed, or it ended): each of them
        computes its prompt here, at once if its own pages have landed, else when they do (never earlier: a
        cuda-ipc peer may still be writing into its blocks). A sharer that will fail shares its own blocks with
        nobody new, and fails those already sharing them."""
        for req_id in request.dependents:
            dependent = self.receiving.get(req_id)
            if dependent is None or request.req_id not in dependent.waits_for or dependent.shared_prefix_failed:
                continue
            dependent.shared_prefix_failed = True
            if dependent.landed is not None:
                self.prefill_locally(dependent, "shared_prefix_failed")
            else:
                self.withdraw(dependent)
        request.dependents = []

    def _drop_pending(self, request: Request) -> None:
        for block_hash in request.pending_hashes:
            if self.pending.get(block_hash, (0, ""))[1] == request.req_id:
                del self.pending[block_hash]
        request.pending_hashes = []

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        budget: int = self.config.max_num_batched_tokens  # type: ignore[assignment]  # resolved (see __init__)
        chunked = self.config.enable_chunked_prefill
        prompt_budget = self._prompt_budget(budget) if chunked else budget
        decodes: list[tuple[Request, int]] = []
        chunks: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not chunked:
                    index += 1  # a whole prompt that does not fit this step; the next one may
                    continue
                num_new = budget
            if chunked and request.is_prefilling:
                num_new = min(num_new, chunk_limit(budget, request.num_computed_tokens), prompt_budget)
                if num_new <= 0:
                    index += 1  # the step's prompt tokens are spent: this prompt continues next step
                    continue
                prompt_budget -= num_new
            if request.spec_token_ids:
                # Verify proposals too, as far as the budget and the free blocks allow: speculation never
                # preempts anyone (its proposals are dropped first).
                del request.spec_token_ids[budget - num_new:]
                needed = num_blocks_for(request.num_tokens + len(request.spec_token_ids), self.block_size)
                if not self.block_pool.can_allocate(needed - len(request.block_ids)):
                    request.spec_token_ids.clear()
                num_new += len(request.spec_token_ids)
            if not self._grow(request, num_new, index, preempted):
                break  # the request itself was preempted: it was the newest, nothing after it runs
            (chunks if request.is_prefilling else decodes).append((request, num_new))
            budget -= num_new
            index += 1
        reserved: list[Request] = []
        if not preempted:  # a step that had to preempt admits nobody new
            self._admit(min(budget, prompt_budget), chunks, reserved)
        if chunks and self.step_sizes:
            fit_step_size(self.step_sizes, decodes, chunks)
        # Decode tokens first (one per request, then the verify runs of requests with proposals), then prompt chunks.
        scheduled = [d for d in decodes if d[1] == 1] + [d for d in decodes if d[1] > 1] + chunks
        if not scheduled and not preempted and not reserved:
            return None
        return SchedulerOutput(requests=[r for r, _ in scheduled], num_new_tokens=[n for _, n in scheduled],
                               preempted=preempted, reserved=reserved)

    def _prompt_budget(self, budget: int) -> int:
        """Prompt tokens this step may compute: `prompt_tokens_while_decoding` when some running request decodes
        and the queue is short (and, with `cap_max_wait_s`, no prompt has waited longer than that), else the whole
        budget."""
        cap = self.config.prompt_tokens_while_decoding
        if not cap or cap >= budget or all(r.is_prefilling for r in self.running):
            return budget
        lifted = max(cap, min(budget, self.cap_lift)) if self.cap_lift else budget
        backlog = 0
        oldest = None
        for request in (*self.running, *self.waiting):
            if request.is_prefilling or (request.status == RequestStatus.WAITING and not request.remote_prefill):
                backlog += request.num_tokens - request.num_computed_tokens
                if backlog > BACKLOG_STEPS * cap:
                    return lifted
                if oldest is None or request.arrival_time < oldest:
                    oldest = request.arrival_time
        if self.cap_max_wait_s and oldest is not None and self.clock() - oldest > self.cap_max_wait_s:
            return lifted
        return cap

    def _grow(self, request: Request, num_new: int, index: int, preempted: list[Request]) -> bool:
        """Blocks for `request`'s next `num_new` tokens, preempting the newest running requests after it (then
        itself) if the pool is short. False if `request` itself was preempted."""
        needed = num_blocks_for(request.num_computed_tokens + num_new, self.block_size) - len(request.block_ids)
        while needed > 0 and not self.block_pool.can_allocate(needed):
            victim = self.running[-1]
            preempted.append(self._preempt(victim))
            if victim is request:
                return False
        if needed > 0:
            request.block_ids += self.block_pool.allocate(needed)
        return True

    def _admit(self, budget: int, chunks: list[tuple[Request, int]], reserved: list[Request]) -> int:
        """Admit waiting requests first come, first served: a prompt to compute joins this step (a chunk of it
        within the budget, or all of it without chunking); a prompt a remote worker computes gets all its blocks
        reserved and waits for its pages. The first request that does not fit stops admission."""
        chunked = self.config.enable_chunked_prefill
        while self.waiting:
            request = self.waiting[0]
            if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            hits = self._find_cached(request)
            num_cached = len(hits) * self.block_size
            if request.remote_prefill and self._cached_but_last_block(request, hits):
                # The whole prompt is cached here but for its last block: a prefill worker would add nothing.
                request.remote_prefill = False
                request.local_prefill_reason = "prefix_cached"
            if request.remote_prefill:
                if not self._reserve(request, hits):
                    break
                reserved.append(request)
                continue
            num_new = request.num_tokens - num_cached
            if budget <= 0 or (num_new > budget and not chunked):
                break
            num_new = min(num_new, chunk_limit(budget, num_cached) if chunked else budget)
            num_blocks = num_blocks_for(num_cached + num_new, self.block_size) - len(hits)
            if not self.block_pool.can_allocate(num_blocks, hits):
                break
            self.waiting.popleft()
            self._take(request, hits, num_blocks)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.num_prefill_tokens = request.num_tokens
            self.running.append(request)
            chunks.append((request, num_new))
            budget -= num_new
        return budget

    def _cached_but_last_block(self, request: Request, hits: list[int]) -> bool:
        """Whether the prompt is cached here but for its last block: a prefill worker would add nothing."""
        return bool(hits) and request.num_tokens - len(hits) * self.block_size <= self.block_size

    def _reserve(self, request: Request, hits: list[int], headroom: int = 0) -> bool:
        """Reserve the blocks of the request at the head of the queue, whose pages a remote worker computes (after
        the `hits` cached here, and the blocks in flight it can share); False when the pool would keep fewer than
        `headroom` blocks free. Its own full prompt blocks become pending for later reservations."""
        shared, owners = self._find_pending(request, len(hits))
        num_blocks = num_blocks_for(request.num_tokens, self.block_size) - len(hits) - len(shared)
        if not self.block_pool.can_allocate(num_blocks + headroom, hits):
            return False
        self.waiting.popleft()
        self._take(request, hits + shared, num_blocks)
        request.status = RequestStatus.WAITING_FOR_KV
        self.receiving[request.req_id] = request
        request.waits_for = owners
        for owner in owners:
            self.receiving[owner].dependents.append(request.req_id)
        if self.prefix_key is not None:
            num_full = request.num_tokens // self.block_size
            hashes = self._hashes(request, num_full)
            for i in range(len(hits) + len(shared), num_full):
                if self.pending.setdefault(hashes[i], (request.block_ids[i], request.req_id))[1] == request.req_id:
                    request.pending_hashes.append(hashes[i])
        return True

    def _find_pending(self, request: Request, start: int) -> tuple[list[int], set[str]]:
        """The pending blocks that continue the request's prefix past its `start` cached blocks (leaving its last
        token to compute), and their owners."""
        if not self.pending:
            return [], set()
        shared: list[int] = []
        owners: set[str] = set()
        for block_hash in self._hashes(request, (request.num_tokens - 1) // self.block_size)[start:]:
            entry = self.pending.get(block_hash)
            if entry is None:
                break
            shared.append(entry[0])
            owners.add(entry[1])
        return shared, owners

    def reserve_waiting(self) -> list[Request]:
        """Decode role, between steps: reserve now what the next step's admission would, for the remote-prefill
        requests at the head of the queue (in order; a request computed here, one that does not fit, or a full batch
        stops it, as in `_admit`), so that their prefill starts without waiting a step (a step of a large batch
        takes 10-20 ms). A request whose prompt is cached here but for its last block is left to `_admit`. A block
        per running request stays free: those grow first in a step, and a reservation must not preempt them."""
        reserved: list[Request] = []
        while self.waiting:
            request = self.waiting[0]
            if not request.remote_prefill or len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            if self.block_pool.num_free_blocks <= len(self.running):
                break  # no block to spare (checked before the prefix lookup: this runs between every two steps)
            hits = self._find_cached(request)
            if self._cached_but_last_block(request, hits):
                break
            if not self._reserve(request, hits, headroom=len(self.running)):
                break
            reserved.append(request)
        return reserved

    # -- prefix cache --------------------------------------------------------------------------
    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first `num_blocks` full blocks (its chain extended as needed)."""
        assert self.prefix_key is not None
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids[len(hashes) * self.block_size:num_blocks * self.block_size]
            hashes += block_hashes(tokens, self.block_size, self.prefix_key, hashes[-1] if hashes else None)
        return hashes[:num_blocks]

    def _find_cached(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix (none when it already holds blocks, or the
        cache is off), leaving at least its last token to compute."""
        if self.prefix_key is None or request.block_ids:
            return []
        return self.block_pool.find_cached(self._hashes(request, (request.num_tokens - 1) // self.block_size))

    def _take(self, request: Request, hits: list[int], num_new_blocks: int) -> None:
        """Admission's blocks: the cached hits (shared), then `num_new_blocks` fresh ones."""
        if self.prefix_key is not None:
            self.block_pool.record_lookup(request.num_tokens, len(hits) * self.block_size)
        self.block_pool.acquire(hits)
        request.block_ids = hits + self.block_pool.allocate(num_new_blocks)
        request.num_cached_tokens = len(hits) * self.block_size
        request.num_registered_blocks = len(hits)

    def _cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full of computed K/V and not registered yet."""
        if self.prefix_key is None:
            return
        # Accepted proposals count as computed a moment before they are appended as tokens: only known tokens hash.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = self._hashes(request, num_full)
        for i in range(request.num_registered_blocks, num_full):
            self.block_pool.cache_full_block(request.block_ids[i], hashes[i])
        request.num_registered_blocks = num_full

    def _preempt(self, request: Request) -> Request:
        """Recompute later: free the blocks now; the request goes back to the front of the queue."""
        self.running.remove(request)
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        # Recomputed here: its pages are gone, whoever computed them first.
        request.remote_prefill = False
        request.local_prefill_reason = "preemption"
        self.waiting.appendleft(request)
        return request

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, token_ids: Sequence[int | Sequence[int]],
                           logprobs: Sequence[float | Sequence[float]]) -> list[Request]:
        """Advance every scheduled request by its computed tokens and append what each that sampled emitted, in
        the order of those requests: a token, or (a verify step) the run of its accepted proposals plus the
        target's next token; finish those that stop. Returns the finished."""
        if output.is_pure_decode:
            return self.update_decodes(output.requests, token_ids, logprobs)
        finished: list[Request] = []
        sampled = iter(zip(token_ids, logprobs, strict=True))
        for request, num_new in zip(output.requests, output.num_new_tokens, strict=True):
            # `output.samples(i)` and `output.num_spec_tokens(i)` from one read of the counters (per request per step).
            num_past_last = request.num_computed_tokens + num_new - request.num_tokens
            num_spec = num_past_last if num_past_last > 0 else 0
            emitted = next(sampled) if num_past_last >= 0 else None
            if request.spec_token_ids:
                request.spec_token_ids = []
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if request.is_prefilling:
                # Counted whoever asked: a prompt computed here, or a preempted request's recomputation.
                reason = request.local_prefill_reason
                request.local_prefill_tokens[reason] = request.local_prefill_tokens.get(reason, 0) + num_new
            if emitted is None:
                request.num_computed_tokens += num_new
                self._cache_blocks(request)
                continue
            ids, probs = emitted
            if isinstance(ids, int):
                ids = [ids]
            if isinstance(probs, float):
                probs = [probs]
            # Only the accepted proposals' K/V count; the rejected ones' slots are rewritten by later steps.
            num_accepted = len(ids) - 1
            request.num_computed_tokens += num_new - num_spec + num_accepted
            request.num_draft_tokens += num_spec
            request.num_accepted_tokens += num_accepted
            self._cache_blocks(request)
            if request.prefill_only:
                self._prefilled(request, ids[0], probs[0])
                continue
            for token_id, logprob in zip(ids, probs, strict=True):
                if self.append_token(request, token_id, logprob):
                    finished.append(request)
                    break
            else:
                if num_spec:
                    self._cache_blocks(request)  # the accepted proposals' blocks, now that they are tokens
                    self._trim(request)
        return finished

    def update_decodes(self, requests: list[Request], token_ids: Sequence[int | Sequence[int]],
                        logprobs: Sequence[float | Sequence[float]]) -> list[Request]:
        """`update_from_output` of a pure decode step (every request computed its last token and emitted one, no
        proposals): the same effects in one pass without the general path's per-request bookkeeping, since at a
        batch of 256 this loop is a tenth of the step (`tests/unit/test_scheduler_update.py` checks it against the
        general path)."""
        finished: list[Request] = []
        running = RequestStatus.RUNNING
        block_size = self.block_size
        caching = self.prefix_key is not None
        eos = self.eos_token_ids
        for request, ids, probs in zip(requests, token_ids, logprobs, strict=True):
            if request.status is not running:
                continue  # aborted while the step ran
            token_id = ids if isinstance(ids, int) else ids[0]
            logprob = probs if isinstance(probs, float) else probs[0]
            computed = request.num_computed_tokens + 1
            request.num_computed_tokens = computed
            if caching and computed // block_size > request.num_registered_blocks:
                self._cache_blocks(request)
            if request.prefill_only:
                self._prefilled(request, token_id, logprob)
                continue
            output = request.output_token_ids
            output.append(token_id)
            request.output_logprobs.append(logprob)
            # `_stop_status` inline: its call costs ~1 us per request (~0.25 ms a step of 238 requests on the CPU VM,
            # a third of this loop); the lockstep test holds the two to the same result.
            params = request.params
            if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos):
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
            elif len(output) >= params.max_tokens:
                self.finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
        return finished

    def advance_prefill(self, output: SchedulerOutput) -> list[Request]:
        """Prefill role, a step launched and not read yet (`Engine`'s prefill pipelining): what `update_from_output`
        does for prompt chunks that needs no sampled token, so that the next step can be scheduled now. Every chunk
        advances; a prompt whose last chunk this was is PREFILLED at once (held, scheduled no more) and gets its
        first token from `apply_first_tokens` once the step is read. Returns those prompts, in the step's order (the
        rows of its sampled tokens)."""
        sampled: list[Request] = []
        for request, num_new in zip(output.requests, output.num_new_tokens, strict=True):
            assert request.prefill_only and not request.spec_token_ids, "only prompt chunks of prefill-only requests"
            reason = request.local_prefill_reason
            request.local_prefill_tokens[reason] = request.local_prefill_tokens.get(reason, 0) + num_new
            request.num_computed_tokens += num_new
            self._cache_blocks(request)
            if request.num_computed_tokens >= request.num_tokens:
                request.status = RequestStatus.PREFILLED
                self.running.remove(request)
                self.prefilled[request.req_id] = request
                sampled.append(request)
        return sampled

    def apply_first_tokens(self, requests: list[Request], token_ids: Sequence[Sequence[int]],
                           logprobs: Sequence[Sequence[float]]) -> None:
        """The first tokens of `advance_prefill`'s prompts, read from their step; a prompt ended meanwhile (aborted,
        released) takes none."""
        for request, ids, probs in zip(requests, token_ids, logprobs, strict=True):
            if request.status is RequestStatus.PREFILLED:
                request.output_token_ids.append(ids[0])
                request.output_logprobs.append(probs[0])

    def _prefilled(self, request: Request, token_id: int, logprob: float) -> None:
        """Prefill role: the prompt is computed and its first token sampled; the decode worker applies the stop
        rules to it. The blocks stay held until the pages are shipped."""
        request.output_token_ids.append(token_id)
        request.output_logprobs.append(logprob)
        request.status = RequestStatus.PREFILLED
        self.running.remove(request)
        self.prefilled[request.req_id] = request

    def _trim(self, request: Request) -> None:
        """After a verify step: free the blocks only rejected proposals used (the next step needs blocks up to its
        last token)."""
        keep = num_blocks_for(request.num_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self.block_pool.free(request.block_ids[keep:])
            request.block_ids = request.block_ids[:keep]  # a new list (see Request.block_ids)

    def append_token(self, request: Request, token_id: int, logprob: float) -> bool:
        """Append one emitted token; True if it ended the request."""
        request.output_token_ids.append(token_id)
        request.output_logprobs.append(logprob)
        status = self._stop_status(request, token_id)
        if status is None:
            return False
        self.finish(request, status)
        return True

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state and free its blocks at once."""
        assert status.is_finished, status
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            del self.receiving[request.req_id]
            self.withdraw(request)
        elif request.status is RequestStatus.PREFILLED:
            del self.prefilled[request.req_id]
        elif request.status.is_finished:
            return
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = status

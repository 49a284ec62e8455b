"""Continuous batching: admission by free KV blocks, FCFS, preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.common.config import SchedulerConfig
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's work: either a prefill batch (whole prompts) or a decode batch (one token each), and the
    requests whose blocks were reserved for a remote prefill this step (they compute nothing here)."""

    is_prefill: bool
    requests: list[Request]
    preempted: list[Request] = field(default_factory=list)
    reserved: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests) if self.is_prefill else len(self.requests)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    """Owns the queues. `schedule()` picks the next step; `update_from_output()` applies its tokens."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.block_pool = block_pool
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode role: requests whose pages a remote prefill worker is writing.
        self.receiving: dict[str, Request] = {}
        # Prefill role: prefilled requests whose blocks are held until their pages are exported.
        self.prefilled: dict[str, Request] = {}

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
        """The pages have landed and the first token is known: the request joins the running batch."""
        del self.receiving[request.req_id]
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def prefill_locally(self, request: Request, reason: str) -> None:
        """A reserved request whose transfer failed: free its blocks and compute its prompt here, first in line
        (it was admitted before everything still waiting)."""
        del self.receiving[request.req_id]
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.remote_prefill = False
        request.local_prefill_reason = reason
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        batch, reserved = self._admit()
        output = SchedulerOutput(is_prefill=True, requests=batch) if batch else self._schedule_decode()
        if reserved:
            output = output or SchedulerOutput(is_prefill=False, requests=[])
            output.reserved = reserved
        return output

    def _admit(self) -> tuple[list[Request], list[Request]]:
        """Admit waiting requests first come, first served: a prompt to compute joins this step's prefill
        batch (within the token budget); a prompt a remote worker computes gets its blocks reserved and waits
        for its pages. A request that does not fit stops admission: no later request overtakes it."""
        batch: list[Request] = []
        reserved: list[Request] = []
        num_tokens = 0
        while self.waiting:
            request = self.waiting[0]
            num_blocks = num_blocks_for(request.num_tokens, self.block_size)
            if (len(self.running) + len(self.receiving) >= self.config.max_num_seqs
                    or not self.block_pool.can_allocate(num_blocks)):
                break
            if not request.remote_prefill and num_tokens + request.num_tokens > self.config.max_num_batched_tokens:
                break
            self.waiting.popleft()
            request.block_ids = self.block_pool.allocate(num_blocks)
            if request.remote_prefill:
                request.status = RequestStatus.WAITING_FOR_KV
                self.receiving[request.req_id] = request
                reserved.append(request)
                continue
            request.status = RequestStatus.RUNNING
            num_tokens += request.num_tokens
            batch.append(request)
            self.running.append(request)
        return batch, reserved

    def _schedule_decode(self) -> SchedulerOutput | None:
        scheduled: list[Request] = []
        preempted: list[Request] = []
        running = list(self.running)
        while running:
            request = running.pop(0)
            # The step writes the K/V of the last token at position num_tokens - 1.
            while num_blocks_for(request.num_tokens, self.block_size) > len(request.block_ids):
                if self.block_pool.can_allocate(1):
                    request.block_ids += self.block_pool.allocate(1)
                elif running:
                    preempted.append(self._preempt(running.pop()))  # the newest gives way
                else:
                    preempted.append(self._preempt(request))
                    request = None
                    break
            if request is not None:
                scheduled.append(request)
            if len(scheduled) >= self.config.max_num_seqs:
                break
        if not scheduled and not preempted:
            return None
        return SchedulerOutput(is_prefill=False, requests=scheduled, preempted=preempted)

    def _preempt(self, request: Request) -> Request:
        """Recompute later: free the blocks now; the request goes back to the front of the queue."""
        self.running.remove(request)
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        # Recomputed here: its pages are gone, whoever computed them first.
        request.remote_prefill = False
        request.local_prefill_reason = "preemption"
        self.waiting.appendleft(request)
        return request

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, token_ids: list[int],
                           logprobs: list[float]) -> list[Request]:
        """Append each request's new token, finish those that stop; returns the finished ones."""
        finished: list[Request] = []
        for request, token_id, logprob in zip(output.requests, token_ids, logprobs, strict=True):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if output.is_prefill:
                reason = request.local_prefill_reason
                request.local_prefill_tokens[reason] = request.local_prefill_tokens.get(reason, 0) + request.num_tokens
            if request.prefill_only:
                # The decode worker applies the stop rules to this token; the pages must ship anyway.
                request.output_token_ids.append(token_id)
                request.output_logprobs.append(logprob)
                request.status = RequestStatus.PREFILLED
                self.running.remove(request)
                self.prefilled[request.req_id] = request
                continue
            self.append_token(request, token_id, logprob)
            if request.status.is_finished:
                finished.append(request)
        return finished

    def append_token(self, request: Request, token_id: int, logprob: float) -> None:
        request.output_token_ids.append(token_id)
        request.output_logprobs.append(logprob)
        status = self._stop_status(request, token_id)
        if status is not None:
            self.finish(request, status)

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
        elif request.status is RequestStatus.PREFILLED:
            del self.prefilled[request.req_id]
        elif request.status.is_finished:
            return
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = status

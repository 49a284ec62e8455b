"""What one step computes (`SchedulerOutput`) and the arithmetic the scheduler sizes it with: the blocks a token
count takes, the share of the token budget a prompt chunk over a long context may take, and the trim of a step's
last chunk to a token count the GPU runs without padding. Pure functions of their arguments: the scheduler's queues
and policy stay in `scheduler.py`; the runner and the engine read a step from here without the scheduler.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engine.request import Request


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# Past this much context a prompt chunk's attention costs as much as its projections and MLP (Llama-3.1-8B on an
# H200: a 32k-token prompt in 2,048-token chunks kept 64 decoding streams' ITL p99 at 144 ms, in 512-token chunks at
# 60 ms; benchmarks/results/h200-2026-12-01/long-prompt-*.json), so chunks over longer contexts shrink in proportion.
LONG_CONTEXT_TOKENS = 8192


def chunk_limit(budget: int, context: int) -> int:
    """Tokens a prompt chunk may take of `budget` when `context` tokens of its prompt are already computed: all of it
    up to LONG_CONTEXT_TOKENS of context, then budget * LONG_CONTEXT_TOKENS / context (at least 1), which keeps a
    step's attention work near that of a full budget at LONG_CONTEXT_TOKENS."""
    if context <= LONG_CONTEXT_TOKENS:
        return budget
    return max(1, budget * LONG_CONTEXT_TOKENS // context)


def fit_step_size(sizes: Sequence[int], decodes: list[tuple[Request, int]], chunks: list[tuple[Request, int]]) -> None:
    """Trim the step's last chunk (in place) to end the step on one of `sizes` (`Scheduler.step_sizes`, ascending)
    when its prompt continues next step anyway and the trim is smaller than the padding up to the next size. (Its
    blocks stay allocated: the prompt needs them next step.)"""
    request, num_new = chunks[-1]
    if request.num_computed_tokens + num_new >= request.num_tokens:
        return  # the prompt's last chunk: trimming it would cost the request a step
    total = sum(n for _, n in decodes) + sum(n for _, n in chunks)
    above = bisect.bisect_left(sizes, total)
    if above == 0 or above == len(sizes) or sizes[above] == total:
        return  # below the smallest size, past the largest (no graphs: no padding), or exact
    trim = total - sizes[above - 1]
    if trim < num_new and trim < sizes[above] - total:
        chunks[-1] = (request, num_new - trim)


@dataclass
class SchedulerOutput:
    """One step's work. `requests[i]` computes `num_new_tokens[i]` tokens from its `num_computed_tokens` on
    (decode tokens first, then prompt chunks); those whose last pending token is among them sample one.
    `reserved`: requests whose blocks were reserved for a remote prefill this step (they compute nothing here)."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request] = field(default_factory=list)
    reserved: list[Request] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        """True when any prompt (or a recomputation) is being computed."""
        return any(r.is_prefilling for r in self.requests)

    @property
    def is_pure_decode(self) -> bool:
        """One token for every request, each of them decoding: the step that runs through the CUDA graphs."""
        return not self.is_prefill and all(n == 1 for n in self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        """Whether requests[index] samples a token this step (its chunk reaches its last token)."""
        request = self.requests[index]
        return request.num_computed_tokens + self.num_new_tokens[index] >= request.num_tokens

    def num_spec_tokens(self, index: int) -> int:
        """Proposals requests[index] verifies this step (its new tokens past its last one)."""
        request = self.requests[index]
        return max(0, request.num_computed_tokens + self.num_new_tokens[index] - request.num_tokens)

"""A request's own state: its tokens, counters and block table (it owns them; nobody else edits)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tandem.engine.attention import KVLayer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Decode role: blocks reserved, pages being written by a remote prefill worker.
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    # Prefill role: the first token is sampled; blocks are held until the pages are exported.
    PREFILLED = "prefilled"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True, eq=False)
class KVMirror:
    """Prefill role: another pool on this device that a request's K/V are stored into as each layer computes
    them (a decode worker's pool mapped by CUDA IPC): `layers` are its per-layer caches (one list object per pool,
    shared by the requests going there), `block_ids` the request's blocks in it, in order."""

    layers: list[KVLayer]
    block_ids: list[int]


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Resolved seed: the params' seed, or one drawn for the request when it arrived.
    seed: int
    # Prefill role: stop after the first token and hold the blocks for export.
    prefill_only: bool = False
    # Prefill role: where else its K/V go (the receiver's pages on this GPU), if anywhere.
    kv_mirror: KVMirror | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Grows in place (`+=`) and is otherwise replaced by a new list, never edited in place: the runner keeps the
    # ids encoded for block tables (`table_row`) and tells a grown list from a new one by identity.
    block_ids: list[int] = field(default_factory=list)
    # The runner's cache of `block_ids` as int32 bytes: (the list it encoded, the bytes of its ids then).
    table_row: tuple[list[int], bytes] | None = field(default=None, repr=False)
    # Tokens whose K/V are in this engine's cache (the scheduler advances it as steps compute them).
    num_computed_tokens: int = 0
    # The tokens it had when last admitted: until they are all computed it is prefilling (its prompt, or a
    # preempted request's recomputation), then decoding.
    num_prefill_tokens: int = 0
    # Prefix cache: hashes of its full blocks so far (a chain, extended as it grows), how many of its blocks are
    # registered in the cache, and how many of its tokens were found there when it was admitted.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Prefill role: leading tokens whose pages the receiver already holds (from its own prefix cache): those
    # pages are not shipped.
    num_receiver_cached_tokens: int = 0
    # Speculative decoding: the proposals the next step verifies, how many it may propose (shrinks while
    # proposals are rejected), and its counters.
    spec_token_ids: list[int] = field(default_factory=list)
    # A draft model's proposals of an unseeded sampled request: the distribution each was drawn from, [k, V] on the
    # device, for rejection sampling (None: exact-match verification).
    spec_draft_probs: torch.Tensor | None = None
    num_spec_allowed: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    # Decode role: the prompt's pages come from a prefill worker (blocks are reserved on admission, then
    # written by the transfer); False once the request is to be computed here instead.
    remote_prefill: bool = False
    # Why the next prefill of this request, if it is computed here, happens here (a metric label): "local"
    # (colocated), or what the service or scheduler set ("no_prefill_worker", "transfer_failed", "preemption").
    local_prefill_reason: str = "local"
    # Prompt tokens this engine computed for the request, by reason (not those received from a prefill worker).
    local_prefill_tokens: dict[str, int] = field(default_factory=dict)
    # Decode role, prefix blocks in flight (`Scheduler.pending`): the reserved requests whose blocks this one shares
    # before their pages have landed (it activates after them), the requests sharing its blocks, its own first
    # token while it waits for those, whether one of those failed (its prompt is then computed here), and the hashes
    # it registered as pending.
    waits_for: set[str] = field(default_factory=set)
    dependents: list[str] = field(default_factory=list)
    landed: tuple[int, float] | None = None
    shared_prefix_failed: bool = False
    pending_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_local_prefill_tokens(self) -> int:
        return sum(self.local_prefill_tokens.values())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int, num: int) -> list[int]:
        """`num` of its tokens from position `start`, the proposals of a verify step after its last token."""
        tokens = self.all_token_ids + self.spec_token_ids
        return tokens[start:start + num]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

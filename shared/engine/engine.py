"""The engine: `step()` = schedule → run the model → apply the tokens. No sockets, no threads.

One engine serves every role:
- colocated: `add_request` then `step()` until done (the offline `LLM`, and the decode worker's
  fallback when no prefill worker is reachable);
- prefill: `add_request(prefill_only=True)`; the step samples the first token and holds the blocks;
  the pages leave as each layer stores them: into a peer pool on the same GPU (`kv_mirror`: one more store per
  layer, nothing afterwards), or through `on_prefill_step`'s per-layer hook (the service copies them out);
  then the service `release`s the request;
- decode: `add_request(remote_prefill=True)`: the scheduler reserves the prompt's blocks when it admits
  the request (first come, first served, with everything else waiting) and reports it in the step's
  `reserved`; the service fills them (`write_pages`, or a peer writes them directly), then `activate`s the
  request with its first token, or gives up and has it computed here (`prefill_locally`).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.common.config import EngineConfig, KVLayout, ModelConfig, env_number
from tandem.common.errors import InvalidRequestError
from tandem.common.sampling_params import SamplingParams
from tandem.common.validation import validate_prompt
from tandem.engine.block_pool import BlockPool
from tandem.engine.draft import DraftProposer, draft_engine_config, draft_kv_share
from tandem.engine.ngram import NgramProposer
from tandem.engine.request import KVMirror, Request, RequestStatus
from tandem.engine.runner import LaunchedStep, ModelRunner
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode import SpeculativeConfig
from tandem.engine.step_plan import SchedulerOutput, num_blocks_for

log = logging.getLogger(__name__)

# 0 or 1 over `EngineConfig.async_scheduling`: how a served stack turns it on (its workers inherit the variable),
# and the A/B in benchmarks/gpu/run.sh.
ASYNC_SCHEDULING_ENV = "TANDEM_ASYNC_SCHEDULING"
# 0 turns prefill pipelining off where async scheduling is on (the A/B in benchmarks/gpu/run.sh).
PREFILL_PIPELINE_ENV = "TANDEM_PREFILL_PIPELINE"
# With a prompt cap (`prompt_tokens_while_decoding`): lift it once a prompt has waited this many milliseconds, and
# to this many prompt tokens rather than the whole budget (experiments: docs/architecture.md).
CAP_MAX_WAIT_ENV = "TANDEM_PROMPT_CAP_MAX_WAIT_MS"
CAP_LIFT_ENV = "TANDEM_PROMPT_CAP_LIFT"


@dataclass
class _PrefillInFlight:
    """A prefill step launched and not read: its schedule and its launch (whose `requests` are the prompts it samples
    a first token for)."""

    output: SchedulerOutput
    launched: LaunchedStep


@dataclass
class StepResult:
    """Requests the step computed tokens for (those that sampled one have it in `output_token_ids`; a prompt
    chunk that is not the last samples none), those that ended, and those whose blocks were reserved for a
    remote prefill."""

    requests: list[Request]
    finished: list[Request]
    is_prefill: bool
    reserved: list[Request] = field(default_factory=list)
    # Tokens computed for each of `requests` this step.
    num_new_tokens: list[int] = field(default_factory=list)
    # Speculative decoding: proposals verified this step, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Draft model: tokens it computed after this step (catch-up and proposals), and how many of them were prompt
    # tokens (its K/V of the prompt are computed here, also on a decode worker whose target pages were shipped).
    num_draft_model_tokens: int = 0
    num_draft_prompt_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 speculative: SpeculativeConfig | None = None, draft_model: ModelConfig | None = None) -> None:
        """`draft_model`: the draft's config when `speculative` names one (else loaded by its name)."""
        self.config = config
        # Speculative decoding: proposals (prompt lookup, or a draft model's) verified in the next step, output
        # unchanged. A draft's KV pool mirrors the target's block ids, so the two pools share the KV budget.
        self.speculative = speculative
        self.proposer: NgramProposer | None = None
        self.draft: DraftProposer | None = None
        draft_config = None
        extra_kv_bytes_per_block = reserved_kv_bytes = 0
        if speculative is not None and speculative.method == "draft_model":
            if draft_model is None:
                from tandem.models import load_model_config

                assert speculative.model is not None  # SpeculativeConfig checks it
                draft_model = load_model_config(speculative.model)
            draft_config = draft_engine_config(config, speculative, draft_model)
            extra_kv_bytes_per_block, reserved_kv_bytes = draft_kv_share(draft_config, speculative)
        elif speculative is not None:
            self.proposer = NgramProposer.from_config(speculative)
        self.runner = runner or ModelRunner(config, extra_kv_bytes_per_block=extra_kv_bytes_per_block,
                                            reserved_kv_bytes=reserved_kv_bytes)
        if draft_config is not None:
            assert speculative is not None
            self.draft = DraftProposer(speculative, draft_config, self.runner.kv_cache.num_blocks)
        self.block_pool = BlockPool(self.runner.kv_cache.num_blocks)
        # Cached K/V are valid only for this model, dtype and KV shape: the layout's fingerprint keys the hashes.
        prefix_key = self.runner.kv_cache.layout.fingerprint().encode() if config.cache.enable_prefix_caching else None
        self.scheduler = Scheduler(config.scheduler, self.block_pool, config.cache.block_size,
                                   config.model.eos_token_ids, prefix_key)
        if self.runner.mixed_graphs is not None:
            self.scheduler.step_sizes = self.runner.mixed_graphs.bucket.exact_sizes()
        # Experiments with the prompt cap (docs/architecture.md, benchmarks/sched_sim.py), not served settings.
        self.scheduler.cap_max_wait_s = env_number(CAP_MAX_WAIT_ENV, 0.0) / 1e3
        self.scheduler.cap_lift = int(env_number(CAP_LIFT_ENV, 0, int))
        self.requests: dict[str, Request] = {}
        self._seed_source = random.Random(config.seed)
        # Prefill role: called once per prefill step with its chunks (request, first token, number of tokens);
        # returns what to call with each layer's index once that layer's K/V are stored (one hand-off per layer
        # per step), or None when nothing is to export.
        self.on_prefill_step: Callable[[list[tuple[Request, int, int]]], Callable[[int], None] | None] | None = None
        # Async scheduling (docs/architecture.md): consecutive pure decode steps are launched one ahead, the next
        # step's inputs built and queued while the GPU runs this one. Not with speculation (a step's proposals
        # depend on the tokens of the one before).
        async_scheduling = config.async_scheduling
        if os.environ.get(ASYNC_SCHEDULING_ENV):
            async_scheduling = bool(env_number(ASYNC_SCHEDULING_ENV, 0, int))
        self.async_scheduling = bool(async_scheduling) and speculative is None
        self._in_flight: LaunchedStep | None = None
        # Prefill pipelining, with async scheduling: a step of prefill-only prompt chunks (a prefill worker's) is
        # launched, then the next one is scheduled and launched before the first's tokens are read, so that the
        # host's part of a step (scheduling, inputs, launches: ~6 ms for 8,192 tokens on the H200 host) overlaps the
        # GPU's work on the one before. No step of prompt chunks needs the tokens of the step before.
        self.pipeline_prefill = self.async_scheduling and bool(env_number(PREFILL_PIPELINE_ENV, 1, int))
        self._prefill_in_flight: _PrefillInFlight | None = None
        self._prefill_reading: _PrefillInFlight | None = None
        # How the host waits for a launched step: given "is it done?" and "block until it is" (the service's engine
        # thread runs queued commands meanwhile); None: block.
        self.wait_for_step: Callable[[Callable[[], bool], Callable[[], None]], None] | None = None

    # -- properties the services report -----------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def layout(self) -> KVLayout:
        return self.runner.kv_cache.layout

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def has_unfinished(self) -> bool:
        # A launched step is read even when everyone in it has ended: its pinned blocks go back then.
        return self.step_in_flight or self.scheduler.has_unfinished()

    @property
    def step_in_flight(self) -> bool:
        """A step is launched and not yet read: the next `step()` has work even if the last result was empty
        (every member of the step it read had been aborted)."""
        return self._in_flight is not None or self._prefill_in_flight is not None

    # -- admission ----------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (naming the field) for a request that can never be served."""
        validate_prompt(prompt_token_ids, self.config.model.vocab_size, self.max_model_len, params.max_tokens)
        needed = num_blocks_for(len(prompt_token_ids) + params.max_tokens, self.config.cache.block_size)
        if needed > self.block_pool.num_blocks:
            raise InvalidRequestError(
                "max_tokens", f"prompt plus max_tokens needs {needed} KV blocks; the pool has "
                              f"{self.block_pool.num_blocks}")

    def new_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, output_token_ids: list[int] | None = None) -> Request:
        """`output_token_ids`: tokens already generated elsewhere (a request resumed after its decode worker
        failed); generation continues after them, with the same seeds, as if it had never moved."""
        if req_id in self.requests:
            raise InvalidRequestError("request_id", f"{req_id!r} is already in flight")
        outputs = list(output_token_ids or [])
        self.validate(prompt_token_ids, params)
        if outputs:
            # max_tokens counts them, so the context check on the prompt alone already covers them.
            vocab_size = self.config.model.vocab_size
            if any(not 0 <= t < vocab_size for t in outputs):
                raise InvalidRequestError("output_token_ids", f"a token id is outside the vocabulary [0, {vocab_size})")
            if len(outputs) >= params.max_tokens:
                raise InvalidRequestError("output_token_ids", f"{len(outputs)} tokens already reach max_tokens")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        return Request(req_id=req_id, prompt_token_ids=list(prompt_token_ids), params=params, seed=seed,
                       prefill_only=prefill_only, output_token_ids=outputs, output_logprobs=[0.0] * len(outputs))

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, output_token_ids: list[int] | None = None, *,
                    remote_prefill: bool = False, local_prefill_reason: str = "local",
                    kv_mirror: KVMirror | None = None, receiver_cached_tokens: int = 0) -> Request:
        """Queue a request. `remote_prefill`: its pages will come from a prefill worker (decode role; `params.seed`
        must be the one that worker samples the first token with). `local_prefill_reason` labels the prompt
        tokens if they are computed here. `kv_mirror` (prefill role): also store its K/V into those pages;
        `receiver_cached_tokens` (prefill role): leading tokens the receiver already holds (never shipped)."""
        request = self.new_request(req_id, prompt_token_ids, params, prefill_only, output_token_ids)
        if receiver_cached_tokens % self.config.cache.block_size or receiver_cached_tokens >= request.num_tokens:
            raise InvalidRequestError("num_cached_tokens", f"{receiver_cached_tokens} must be a multiple of the block "
                                                           f"size below the request's {request.num_tokens} tokens")
        request.num_receiver_cached_tokens = receiver_cached_tokens
        if kv_mirror is not None:
            needed = num_blocks_for(request.num_tokens, self.config.cache.block_size)
            if len(kv_mirror.block_ids) != needed:
                raise InvalidRequestError("target.block_ids", f"{len(kv_mirror.block_ids)} blocks for "
                                                              f"{request.num_tokens} tokens; {needed} needed")
            request.kv_mirror = kv_mirror
        request.remote_prefill = remote_prefill
        request.local_prefill_reason = local_prefill_reason
        self.requests[req_id] = request
        self.scheduler.add(request)
        return request

    def reserve_waiting(self) -> list[Request]:
        """Decode role, between steps: reserve the blocks of the remote-prefill requests at the head of the queue
        now rather than in the next step (`Scheduler.reserve_waiting`); the requests reserved."""
        return self.scheduler.reserve_waiting()

    def abort(self, req_id: str) -> None:
        """End a request wherever it is and free its blocks now; unknown ids are ignored."""
        request = self.requests.pop(req_id, None)
        if request is not None:
            self._settle(request)
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            if self.draft is not None:
                self.draft.forget(req_id)

    # -- the loop -------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        if self._in_flight is not None:
            return self._read_in_flight()
        if self._prefill_in_flight is not None:
            return self._read_prefill()
        output = self.scheduler.schedule()
        if output is None:
            return StepResult([], [], is_prefill=False)
        if not output.requests:  # only reservations: nothing to compute
            return StepResult([], [], is_prefill=False, reserved=output.reserved)
        for request in output.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
        is_prefill = output.is_prefill
        if self.async_scheduling and output.is_pure_decode:
            self._in_flight = self.runner.launch_decode(output.requests)
            result = self._read_in_flight()
            # This step's admission may have reserved blocks for remote prefills beside its decodes: their
            # callers start the transfers (dropped, a reserved request waited for its pages forever).
            result.reserved = output.reserved
            return result
        if self.pipeline_prefill and self._pipelines(output):
            self._prefill_in_flight = self._launch_prefill(output)
            return self._read_prefill()
        token_ids, logprobs = self.runner.execute(output, self._prefill_hook(output) if is_prefill else None)
        num_spec: list[int] = []
        sampled: list[bool] = []
        num_draft = num_accepted = 0
        if self.speculative is not None:  # only speculation makes proposals
            # Read before the update moves each request's computed tokens on.
            num_spec = [output.num_spec_tokens(i) for i in range(len(output.requests))]
            sampled = [output.samples(i) for i in range(len(output.requests))]
            num_draft = sum(num_spec)
            num_accepted = sum(len(ids) - 1 for ids in token_ids) if num_draft else 0
        finished = self.scheduler.update_from_output(output, token_ids, logprobs)
        for request in finished:
            self.requests.pop(request.req_id, None)
        result = StepResult(output.requests, finished, is_prefill, output.reserved, output.num_new_tokens,
                            num_draft, num_accepted)
        if self.speculative is not None:
            self._propose(output.requests, token_ids, sampled, num_spec)
            if self.draft is not None:
                result.num_draft_model_tokens = self.draft.last_num_tokens
                result.num_draft_prompt_tokens = self.draft.last_num_prompt_tokens
        return result

    # -- async scheduling ------------------------------------------------------------------------------
    def _read_in_flight(self) -> StepResult:
        """Launch the step after the one in flight when it can be (`_launch_next`), then read the one in flight
        and apply its tokens: the host's work for step N+1 and for step N's tokens overlaps N+1's forward."""
        current = self._in_flight
        assert current is not None
        self._in_flight = None
        try:
            self._in_flight = self._launch_next(current)
            token_ids, logprobs = current.result(self.wait_for_step)
            # Requests aborted, or ended by a token of the step before, while this one ran: their rows are dropped.
            live = [r.status is RequestStatus.RUNNING for r in current.requests]
            finished = self.scheduler.update_decodes(current.requests, token_ids, logprobs)
        except BaseException:
            if self._in_flight is not None:  # a failed step fails what is in flight (the caller aborts it)
                self.block_pool.free(self._in_flight.pinned)
                self._in_flight = None
            raise
        finally:
            self.block_pool.free(current.pinned)
        for request in finished:
            self.requests.pop(request.req_id, None)
        requests = [r for r, is_live in zip(current.requests, live, strict=True) if is_live]
        return StepResult(requests, finished, False, num_new_tokens=[1] * len(requests))

    def _launch_next(self, current: LaunchedStep) -> LaunchedStep | None:
        """The pure decode step after `current` (launched, not read), if it is what the scheduler would run: no
        request waits or joined since, every running request is in `current`, and each one that may still be
        running after it gets a slot for one more token (without preempting anyone). Requests that `current`'s
        token ends by length are left out; those its token may stop (EOS, a stop token) are not known yet and run
        one token too many, which is dropped when read."""
        scheduler = self.scheduler
        if scheduler.waiting or scheduler.prefilled:
            return None
        rows_of = {id(r): i for i, r in enumerate(current.requests)}
        requests: list[Request] = []
        rows: list[int] = []
        for request in scheduler.running:
            row = rows_of.get(id(request))
            if row is None or request.is_prefilling or request.prefill_only:
                return None
            if len(request.output_token_ids) + 1 >= request.params.max_tokens:
                continue
            requests.append(request)
            rows.append(row)
        if not requests or len(requests) > self.config.budget:
            return None
        bs = self.config.cache.block_size
        # Position num_tokens (one past the last token the host knows) is written by the next step.
        growing = [r for r in requests if r.num_tokens // bs >= len(r.block_ids)]
        if growing and not self.block_pool.can_allocate(len(growing)):
            return None
        for request in growing:
            request.block_ids += self.block_pool.allocate(1)
        pinned = [r.block_ids[r.num_tokens // bs] for r in requests]
        self.block_pool.acquire(pinned)
        launched = self.runner.launch_decode(requests, current, rows)
        launched.pinned = pinned
        return launched

    # -- prefill pipelining ----------------------------------------------------------------------------
    def _pipelines(self, output: SchedulerOutput) -> bool:
        """A step of prompt chunks of prefill-only requests only (a prefill worker's), which the next step's
        schedule does not depend on."""
        return not output.reserved and all(r.prefill_only and r.is_prefilling for r in output.requests)

    def _launch_prefill(self, output: SchedulerOutput) -> _PrefillInFlight:
        """Launch a step of prompt chunks and apply what it does that needs no token (`Scheduler.advance_prefill`)."""
        now = time.monotonic()
        for request in output.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        launched = self.runner.launch_chunks(output, self._prefill_hook(output))
        sampled = self.scheduler.advance_prefill(output)
        assert [id(r) for r in sampled] == [id(r) for r in launched.requests], "sampled rows out of order"
        return _PrefillInFlight(output, launched)

    def _prefill_hook(self, output: SchedulerOutput) -> Callable[[int], None] | None:
        """The prefill role's per-layer hand-off for a step with prompt tokens (`on_prefill_step`), if any."""
        if self.on_prefill_step is None:
            return None
        return self.on_prefill_step([(r, r.num_computed_tokens, n)
                                     for r, n in zip(output.requests, output.num_new_tokens, strict=True)])

    def _read_prefill(self) -> StepResult:
        """Launch the next step of prompt chunks when the scheduler has one (only prefill-only requests wait), then
        read the step in flight and give its prompts their first tokens."""
        current = self._prefill_in_flight
        assert current is not None
        self._prefill_in_flight = None
        self._prefill_reading = current
        try:
            scheduler = self.scheduler
            if (scheduler.waiting or scheduler.running) and all(
                    r.prefill_only for queue in (scheduler.waiting, scheduler.running) for r in queue):
                output = scheduler.schedule()
                if output is not None and output.requests:
                    assert self._pipelines(output), "a prefill-only queue scheduled something else"
                    self._prefill_in_flight = self._launch_prefill(output)
            token_ids, logprobs = current.launched.result(self.wait_for_step)
        except BaseException:
            # A failed step fails what is in flight too: the caller aborts every request (its prompts were
            # advanced past the launched chunks, so nothing else could compute them again). Before the aborts hand
            # blocks back, whatever those steps queued on the GPU finishes: their stores may target a receiver's
            # pool, which is about to be told that no write of theirs follows (`_settle` no longer sees them).
            self._drain_after_failure()
            self._prefill_in_flight = None
            raise
        finally:
            self._prefill_reading = None
        self.scheduler.apply_first_tokens(current.launched.requests, token_ids, logprobs)
        live = (RequestStatus.RUNNING, RequestStatus.PREFILLED)
        kept = [(r, n) for r, n in zip(current.output.requests, current.output.num_new_tokens, strict=True)
                if r.status in live]
        return StepResult([r for r, _ in kept], [], True, num_new_tokens=[n for _, n in kept])

    def _drain_after_failure(self) -> None:
        """Wait for the GPU work of failed launched steps, best effort: the whole device, since a launch that failed
        part-way recorded no event; an error that poisoned the context is the caller's already."""
        if self.runner.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.runner.device)
        except Exception:  # the step's own error is what propagates
            log.exception("waiting for a failed prefill step's GPU work failed")

    def _settle(self, request: Request) -> None:
        """Before a request's blocks go back: wait for a launched prefill step that computes for it, whose stores
        may be headed for a receiver's pool (which its caller is about to be told no write of it follows)."""
        for step in (self._prefill_reading, self._prefill_in_flight):
            if step is not None and step.launched.done is not None and any(r is request for r in step.output.requests):
                step.launched.done.synchronize()

    # -- speculative decoding ---------------------------------------------------------------------------
    # A request whose proposals are all rejected proposes half as many next time; at none, it waits this many
    # steps before trying one again: speculation backs off where the text does not repeat itself.
    SPEC_COOLDOWN_STEPS = 16

    def _propose(self, requests: list[Request], emitted: list[list[int]], sampled: list[bool],
                 num_spec_tokens: list[int]) -> None:
        """After a step: adapt each request's allowance to how its proposals fared, then propose for the next
        step (prompt lookup, or the draft model) for every request that is decoding."""
        assert self.speculative is not None
        k_max = self.speculative.num_speculative_tokens
        runs = iter(emitted)
        for request, samples, num_spec in zip(requests, sampled, num_spec_tokens, strict=True):
            run = next(runs) if samples else None
            if run is None or not num_spec:
                continue
            if len(run) - 1 == num_spec:  # all accepted
                request.num_spec_allowed = min(k_max, max(1, request.num_spec_allowed) * 2)
            elif len(run) == 1:  # none accepted
                request.num_spec_allowed //= 2
                if request.num_spec_allowed == 0:
                    request.num_spec_allowed = -self.SPEC_COOLDOWN_STEPS
        candidates = []
        limit = self.speculative.disable_by_batch_size
        # A batch this large speculates no more (until it shrinks): only the allowances above keep adapting.
        batch_too_large = limit is not None and len(self.scheduler.running) >= limit
        for request in requests:
            request.spec_draft_probs = None
            if batch_too_large:
                continue
            if request.status is not RequestStatus.RUNNING or request.is_prefilling or request.prefill_only:
                continue
            if request.num_spec_allowed < 0:  # cooling down; then it tries one proposal again
                request.num_spec_allowed += 1
                if request.num_spec_allowed == 0:
                    request.num_spec_allowed = 1
                continue
            if request.num_spec_allowed == 0 and request.num_draft_tokens == 0:
                request.num_spec_allowed = k_max  # its first proposal
            room = min(request.params.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens)
            if min(request.num_spec_allowed, room) > 0:
                candidates.append((request, min(request.num_spec_allowed, room)))
        if self.draft is not None:
            # Run even without candidates: the round's counters start from zero.
            proposals, draft_probs = self.draft.propose(candidates)
            for (request, _), proposal, probs in zip(candidates, proposals, draft_probs, strict=True):
                request.spec_token_ids = proposal
                request.spec_draft_probs = probs
            return
        if not candidates:
            return
        assert self.proposer is not None
        proposals = self.proposer.propose([r.all_token_ids for r, _ in candidates])
        for (request, k), proposal in zip(candidates, proposals, strict=True):
            request.spec_token_ids = proposal[:k]

    def warm_up(self) -> None:
        """Compile and load what the first requests would otherwise wait for: the prefill path (Triton kernels
        specialise on lengths that are and are not multiples of 16), the sampler and, in every role, a release.
        The decode path was warmed when its CUDA graphs were captured."""
        vocab = self.config.model.vocab_size
        self.runner.warm_up_attention()
        # Whole prompts through the model: GEMM shapes and the kernels' remaining variants (on a GPU, lengths
        # across the contiguous attention's tile sizes too).
        lengths = (16, 17, 33, 65, 129) if self.runner.device.type == "cuda" else (16, 17)
        for num_tokens in lengths:
            if num_tokens >= self.max_model_len:
                continue
            req_id = f"warm-up-{num_tokens}"
            prompt = [(7 * i + 1) % vocab for i in range(num_tokens)]
            # Seeded: an unseeded request would draw from the engine's seed source and shift later requests' seeds.
            self.add_request(req_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, seed=0), prefill_only=True)
            while self.requests[req_id].status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                self.step()
            self.release(req_id)
        if self.runner.device.type == "cuda":
            self._warm_up_full_step()
        if self.draft is not None and self.speculative is not None:
            # A draft model's catch-up, decode steps and the verify step: a few tokens decoded here.
            max_tokens = self.speculative.num_speculative_tokens + 2
            num_tokens = min(17, self.max_model_len - max_tokens)
            if num_tokens > 0:
                prompt = [(7 * i + 1) % vocab for i in range(num_tokens)]
                self.add_request("warm-up-draft", prompt,
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0, ignore_eos=True))
                while "warm-up-draft" in self.requests:
                    self.step()

    def _warm_up_full_step(self) -> None:
        """One step of prompts at the whole token budget (as far as the pool holds them): the caching allocator
        takes the largest step's activations and the GEMMs meet their largest shapes now. On the H200 the first
        8,192-token batch of a fresh llama-3.2-1b prefill worker took 121 ms against 38-55 for the next seven
        (benchmarks/results/h200-2026-12-04c), and every request of that burst waited for it."""
        budget = self.scheduler.config.max_num_batched_tokens or 0
        num_tokens = min(budget, self.max_model_len - 1)
        spare_tokens = (self.block_pool.num_free_blocks - 1) * self.runner.block_size
        num_prompts = min(budget, spare_tokens) // num_tokens if num_tokens > 0 else 0
        vocab = self.config.model.vocab_size
        req_ids = [f"warm-up-step-{i}" for i in range(num_prompts)]
        for i, req_id in enumerate(req_ids):
            prompt = [(11 * j + 3 * i + 1) % vocab for j in range(num_tokens)]
            self.add_request(req_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, seed=0), prefill_only=True)
        while any(self.requests[r].status in (RequestStatus.WAITING, RequestStatus.RUNNING) for r in req_ids):
            self.step()
        for req_id in req_ids:
            self.release(req_id)

    # -- prefill role -----------------------------------------------------------------------------------
    def read_pages(self, request: Request, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of one layer for the request's blocks, [num_blocks, block_size, Hkv, D]."""
        return self.runner.kv_cache.read_blocks(layer, request.block_ids)

    def release(self, req_id: str) -> None:
        """The pages are shipped (or the receiver went away): free the prefilled request's blocks."""
        request = self.requests.pop(req_id, None)
        if request is not None:
            self._settle(request)
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    # -- decode role ------------------------------------------------------------------------------------
    def write_pages(self, req_id: str, layer: int, block_start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Pages of a reserved request, [num_blocks, block_size, Hkv, D] each, into its blocks from `block_start`
        (an index into the request's own block list). Ignored if the request is gone (aborted meanwhile)."""
        request = self.requests.get(req_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
            return
        # Blocks found in the prefix cache are shared with other requests: never written (and never sent).
        assert block_start >= request.num_cached_tokens // self.config.cache.block_size, "pages of a cached block"
        block_ids = request.block_ids[block_start:block_start + k.shape[0]]
        assert len(block_ids) == k.shape[0], "pages past the reserved blocks"
        self.runner.kv_cache.write_blocks(layer, block_ids, k, v)

    def activate(self, req_id: str, first_token_id: int, logprob: float) -> list[Request]:
        """The prompt's pages are in place and its first token known: join the running batch. A request that
        shares blocks still in flight for others waits for them (it joins when they do: all are returned), or
        computes its prompt here if one of them failed. Returns the requests that joined (to publish)."""
        request = self.requests[req_id]
        if request.shared_prefix_failed:
            self.scheduler.prefill_locally(request, "shared_prefix_failed")
            return []
        request.landed = (first_token_id, logprob)
        if request.waits_for:
            return []
        activated = []
        ready = [request]
        while ready:
            request = ready.pop()
            assert request.landed is not None
            (token_id, token_logprob), request.landed = request.landed, None
            self.scheduler.activate(request)
            self.scheduler.append_token(request, token_id, token_logprob)
            if request.status.is_finished:
                self.requests.pop(request.req_id, None)
            activated.append(request)
            ready += self.scheduler.released_by(request)
        return activated

    def withdraw(self, req_id: str) -> None:
        """The remote prefill of a reserved request is failing (its writer may still be stopping): no later request
        shares its blocks, and those sharing them compute their prompts here once their own pages are in."""
        request = self.requests.get(req_id)
        if request is not None and request.status is RequestStatus.WAITING_FOR_KV:
            self.scheduler.withdraw(request)

    def expire_shared_wait(self, req_id: str) -> None:
        """A request whose pages have landed still waits for those whose blocks it shares: compute its prompt here
        instead (its own transfer is done; the blocks it shared stay with their owners)."""
        request = self.requests.get(req_id)
        if request is not None and request.status is RequestStatus.WAITING_FOR_KV and request.landed is not None:
            self.scheduler.prefill_locally(request, "shared_prefix_wait")

    def prefill_locally(self, req_id: str, reason: str) -> None:
        """The remote prefill of a reserved request failed: compute its prompt here (counted under `reason`)."""
        request = self.requests.get(req_id)
        if request is not None and request.status is RequestStatus.WAITING_FOR_KV:
            self.scheduler.prefill_locally(request, reason)

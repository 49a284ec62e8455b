"""The gateway's pipeline, shared by its gRPC and HTTP doors: tokenize and validate, pick a (prefill, decode)
pair, stream through the decode worker's session, detokenize, and resume on another worker after a failure.

The gateway owns text: decode workers stream token ids; the gateway turns them into text, matches stop
strings, and on a stop cancels the request on decode, so no compute is spent past it.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context

from tandem.common.config import ModelConfig
from tandem.common.errors import DeadlineExceededError, InvalidRequestError, OverloadedError, UnavailableError
from tandem.common.sampling_params import SamplingParams
from tandem.common.validation import validate_prompt, validate_sampling
from tandem.gateway.admission import Admission, held_slots
from tandem.gateway.kv_routing import (
    NUM_TRACED_CANDIDATES,
    OFFLOAD_BLOCKS,
    Choice,
    KVRouter,
    KVRoutingConfig,
    PromptBlocks,
)
from tandem.gateway.limits import GatewayLimits
from tandem.gateway.prompts import PromptEncoder
from tandem.gateway.sessions import DecodeSession, SessionChannels, SessionEnded, StreamPacer
from tandem.models.detokenizer import IncrementalDetokenizer
from tandem.serving import metrics
from tandem.serving.registry import Registry, WorkerRecord
from tandem.serving.rpc import PEER_FAILURE_CODES, TlsConfig, typed_error
from tandem.serving.telemetry import ending, get_tracer, inject_metadata
from tandem.serving.wire import (
    finish_reason_from_proto,
    sampling_to_worker,
    with_resolved_seed,
)
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayModel:
    """The served model as the gateway knows it: its name, its own context cap (the workers' may be lower:
    `Router.max_model_len` takes the smaller) and tokenizer."""

    name: str
    config: ModelConfig
    max_model_len: int
    tokenizer: Any


@dataclass
class Completion:
    """One request's progress as the gateway tracks it (shared with the HTTP API)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    # The text so far in the pieces it came in (`text` joins them; appending to one string would copy it
    # on every token).
    text_parts: list[str] = field(default_factory=list)
    # The chosen token's logprob for each of token_ids (as decode reports them).
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    time_to_first_token_s: float = 0.0
    e2e_s: float = 0.0
    # Prompt tokens the decode worker had in its prefix cache (on the attempt that finished the request).
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Router:
    """Routes token-level requests to a decode worker and yields (new token ids, new text) chunks.

    Used by the gRPC servicer and by the OpenAI-compatible HTTP API alike.
    """

    def __init__(self, model: GatewayModel, registry: Registry, tracer: trace.Tracer | None = None,
                 max_concurrent_requests: int = 1024, tls: TlsConfig | None = None,
                 limits: GatewayLimits | None = None, kv_routing: KVRoutingConfig | None = None,
                 internal_token: str | None = None) -> None:
        # TLS (with this gateway's certificate, for mutual TLS) on the calls to decode workers, and the stack's
        # internal token on each of them (`tandem.serving.auth`).
        self.tls = tls
        self.model = model
        self.registry = registry
        # What one request may ask for (sizes, counts), and how long a decode worker may stay silent.
        self.limits = limits or GatewayLimits()
        # Backpressure: past this many sequences in flight (gRPC and HTTP together), RESOURCE_EXHAUSTED at once.
        self.admission = Admission(max_concurrent_requests)
        # The process-wide tracer unless one is given (tests host several services in one process).
        self.tracer = tracer or get_tracer("gateway")
        self._encoder = PromptEncoder(model.tokenizer)
        # Which workers to send a request to: cached prefix against load, with this gateway's own placements.
        self.kv_router = KVRouter(kv_routing)
        # Channels for the decode sessions only (`SessionChannels`: a fixed flow-control window).
        self._channels = SessionChannels(tls, internal_token)
        self._sessions: dict[str, DecodeSession] = {}
        # Larger client messages while this process's event loop is saturated (`--max-stream-interval`), or None.
        limits = self.limits
        self.pacer = (StreamPacer(limits.max_stream_interval)
                      if limits.max_stream_interval > limits.stream_interval else None)
        self._refused: set[str] = set()  # workers of another model, logged once each

    # -- the limits it enforces: the workers' ----------------------------------------------------------------
    def decode_workers(self) -> list[WorkerRecord]:
        """Decode workers serving this gateway's model (a worker of another model is refused, logged once)."""
        return self._of_model(self.registry.workers("decode"))

    def _of_model(self, workers: list[WorkerRecord]) -> list[WorkerRecord]:
        accepted = []
        for worker in workers:
            if worker.model and worker.model != self.model.name:
                if worker.address not in self._refused:
                    self._refused.add(worker.address)
                    log.error("refusing %s worker %s: it serves %r, this gateway %r", worker.role, worker.address,
                              worker.model, self.model.name)
                continue
            accepted.append(worker)
        metrics.WORKERS_REFUSED.set(len(self._refused))
        return accepted

    @property
    def max_model_len(self) -> int:
        """The context length requests are checked against: the smallest of this gateway's cap and what the
        decode workers report (a worker that has not reported yet does not count)."""
        reported = [w.max_model_len for w in self.decode_workers() if w.max_model_len > 0]
        return min([self.model.max_model_len, *reported])

    @property
    def vocab_size(self) -> int:
        reported = [w.vocab_size for w in self.decode_workers() if w.vocab_size > 0]
        return min(reported) if reported else self.model.config.vocab_size

    async def prompt_ids(self, prompt: str | None = None, token_ids: list[int] | None = None,
                         messages: list[dict[str, str]] | None = None) -> list[int]:
        """Exactly one input → the prompt's token ids (validated against the vocabulary), traced as a
        `tokenize` span under the current one. Sizes are checked before anything is encoded, and a large
        prompt is encoded off the event loop."""
        with self.tracer.start_as_current_span("tokenize") as span:
            ids = await self._tokenize(prompt, token_ids, messages)
            span.set_attribute("tandem.prompt_tokens", len(ids))
            return ids

    async def _tokenize(self, prompt: str | None, token_ids: list[int] | None,
                        messages: list[dict[str, str]] | None) -> list[int]:
        max_model_len = self.max_model_len
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages", "must not be empty")
            ids = await self._encoder.chat(self.limits.check_messages(messages, max_model_len))
        elif prompt is not None:
            self.limits.check_prompt(prompt, max_model_len)
            ids = await self._encoder.text(prompt)
        elif token_ids is not None:
            ids = list(token_ids)
        else:
            raise InvalidRequestError("input", "one of prompt, prompt_token_ids or messages is required")
        validate_prompt(ids, self.vocab_size, max_model_len)
        return ids

    def check_sampling(self, params: SamplingParams) -> None:
        """Sampling values a worker can be sent, and stop lists within the limits (InvalidRequestError)."""
        self.limits.check_stop(params.stop, params.stop_token_ids)
        validate_sampling(params, self.vocab_size)

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def begin_drain(self) -> None:
        """From now on every new request is refused (UNAVAILABLE, HTTP 503); those in flight go on."""
        self.admission.begin_drain()

    def check_model(self, name: str) -> None:
        if name and name != self.model.name:
            raise InvalidRequestError("model", f"unknown model {name!r}; this gateway serves {self.model.name!r}")

    def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               timeout: float | None = None, trace_context: Context | None = None,
               ) -> AsyncGenerator[tuple[list[int], str, Completion], None]:
        """Yield (new token ids, new text, progress) as decode streams; the last has finish_reason set.

        A decode worker that fails (unreachable, dies, ends the stream early, or is full) is left out and
        the request goes on on another one: before any token it simply starts there; after some tokens it
        resumes with the tokens already yielded (the new worker re-prefills prompt + those tokens and,
        sampling being placement-free, continues token-exact), so the caller sees one stream. It ends with
        UNAVAILABLE (RESOURCE_EXHAUSTED if the last worker was full) only when no decode worker is left.

        Traced as a `route` span per attempt and a `stream` span (the decode calls and detokenization)
        under `trace_context`, by default the caller's current context; decode continues the trace.

        Nothing runs before the first chunk is asked for (the checks, then the admission slot). The generator
        returned is `_stream` itself, not one wrapped around it: every generator layer costs each message a step.
        """
        return self._stream(request_id, prompt_ids, params, timeout, trace_context)

    async def _stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      timeout: float | None, trace_context: Context | None,
                      ) -> AsyncGenerator[tuple[list[int], str, Completion], None]:
        validate_prompt(prompt_ids, self.vocab_size, self.max_model_len, params.max_tokens)
        self.check_sampling(params)
        params = with_resolved_seed(params)
        # A request that took a slot for each of its sequences already (`Slots.create_task`) takes none here.
        with contextlib.nullcontext() if held_slots() is not None else self.admission.hold(1):
            arrival = time.perf_counter()
            deadline = None if timeout is None else arrival + timeout
            parent = otel_context.get_current() if trace_context is None else trace_context
            detok = IncrementalDetokenizer(self.model.tokenizer, prompt_ids, stop=params.stop,
                                           skip_special_tokens=params.skip_special_tokens)
            progress = Completion(request_id, prompt_ids, [])
            prompt = PromptBlocks(prompt_ids)  # hashed once, for every attempt
            failed: set[str] = set()  # decode workers this request has given up on
            last_error: Exception | None = None
            span = self.tracer.start_span("stream", context=parent, attributes={
                "tandem.request_id": request_id, "tandem.prompt_tokens": len(prompt_ids),
                "tandem.max_tokens": params.max_tokens})
            with ending(span):
                try:
                    while True:
                        try:
                            prefill, decode, local_reason = await self._route(parent, prompt, exclude=failed)
                        except UnavailableError:
                            metrics.REQUESTS.labels(status="error").inc()
                            if isinstance(last_error, OverloadedError):
                                raise last_error from None
                            raise UnavailableError(f"no decode worker left for {request_id}"
                                                   + (f" (last: {last_error})" if last_error else "")) from None
                        if not failed:
                            span.set_attribute("tandem.decode.address", decode.address)
                        else:
                            span.add_event("resume", {"tandem.decode.address": decode.address,
                                                      "tandem.resumed_tokens": len(progress.token_ids)})
                            log.warning("%s: resuming on %s after %d tokens (%s)", request_id, decode.address,
                                        len(progress.token_ids), last_error)
                        remaining = None if deadline is None else max(1e-3, deadline - time.perf_counter())
                        try:
                            async for chunk in self._attempt(decode, prefill, request_id, prompt_ids, params,
                                                             remaining, span, detok, progress, arrival, local_reason):
                                yield chunk
                            return
                        except _RetryableError as error:
                            failed.add(decode.address)
                            last_error = error.cause
                finally:
                    span.set_attributes({"tandem.completion_tokens": len(progress.token_ids),
                                         "tandem.finish_reason": progress.finish_reason or "",
                                         "tandem.time_to_first_token_s": progress.time_to_first_token_s,
                                         "tandem.num_decode_failures": len(failed)})

    async def _attempt(self, decode: WorkerRecord, prefill: WorkerRecord | None, request_id: str,
                       prompt_ids: list[int], params: SamplingParams, timeout: float | None, span: trace.Span,
                       detok: IncrementalDetokenizer, progress: Completion, arrival: float,
                       local_reason: str = "") -> AsyncGenerator[tuple[list[int], str, Completion], None]:
        """One decode call, continuing `progress` (`local_reason`: why decode prefills it, when it does though a
        prefill worker is up); raises `_RetryableError` when another worker may finish the request."""
        session = self._session(decode.address)
        # Workers key requests by id: a suffix per attempt keeps two clients' equal ids (or a retry racing
        # the old attempt's cleanup) apart, while logs and traces still show the client's id.
        worker_request_id = f"{request_id}#{uuid.uuid4().hex[:8]}"
        updates = session.start(worker_pb2.DecodeRequest(
            request_id=worker_request_id, prompt_token_ids=prompt_ids, sampling=sampling_to_worker(params),
            prefill_address=prefill.address if prefill is not None else "",
            local_prefill_reason=local_reason,
            output_token_ids=progress.token_ids), timeout, dict(inject_metadata(trace.set_span_in_context(span)) or ()),
            self.limits.stream_interval, self.pacer)
        ended = False
        is_first = True
        try:
            while True:
                update = await updates.next()  # all the tokens that have come, in one message to the client
                if isinstance(update, SessionEnded):
                    ended = True
                    raise _attempt_error(update.code, update.details)
                if update.error_code:
                    ended = True
                    raise _attempt_error(_CODES[update.error_code], update.error_message, update.error_type)
                response = update.response
                if is_first:
                    is_first = False
                    # A resumed attempt's count covers its earlier output too: only prompt tokens are reported.
                    progress.num_cached_tokens = min(response.num_cached_tokens, len(prompt_ids))
                if not progress.token_ids:
                    progress.time_to_first_token_s = time.perf_counter() - arrival
                new_ids = list(response.token_ids)
                new_logprobs = list(response.logprobs)
                text = detok.push(new_ids)
                if detok.stopped:
                    # Only the tokens up to the one completing the stop string count.
                    new_ids = new_ids[:detok.num_tokens_used - len(progress.token_ids)]
                    new_logprobs = new_logprobs[:len(new_ids)]
                    progress.finish_reason = "stop"
                elif response.finish_reason:
                    progress.finish_reason = finish_reason_from_proto(response.finish_reason)
                    text += detok.finish()
                    ended = True
                progress.token_ids += new_ids
                progress.logprobs += new_logprobs
                progress.text_parts.append(text)
                if progress.finish_reason is not None:
                    progress.e2e_s = time.perf_counter() - arrival
                    _observe(progress)
                    yield new_ids, text, progress
                    return
                yield new_ids, text, progress
        finally:
            # A stop string, a client cancel or an error: decode frees the request's blocks at once.
            session.finish(worker_request_id, cancel=not ended)

    def _session(self, address: str) -> DecodeSession:
        """The session to a decode worker, opened on first use and again after it ended."""
        session = self._sessions.get(address)
        if session is None or session.closed:
            if self.pacer is not None:
                self.pacer.start()  # on the serving loop, once
            session = self._sessions[address] = DecodeSession(self._channels.get(address), address,
                                                              stall_timeout_s=self.limits.decode_stall_timeout_s)
        return session

    async def _route(self, parent: Context, prompt: PromptBlocks, exclude: set[str] | frozenset[str] = frozenset(),
                     ) -> tuple[WorkerRecord | None, WorkerRecord, str]:
        """The (prefill, decode) pair for a request and, when a prefill worker was passed over, why ("short_prompt":
        `local_prefill_max_tokens`), in a `route` span that says which and why (`KVRouter`); decode workers in
        `exclude` (those this request has failed on) are left out. The pair counts as placed at once."""
        with ending(self.tracer.start_span("route", context=parent)) as span:
            prefills = self._of_model(self.registry.workers("prefill"))
            decodes = [d for d in self.decode_workers() if d.address not in exclude]
            await self._hash(prompt, [*prefills, *decodes])
            prefill_choice, decode_choice = self.kv_router.choose_pair(prefills, decodes, prompt)
            decode = decode_choice.worker
            prefill = prefill_choice.worker if prefill_choice is not None else None
            local_reason = ""
            local_max = self.limits.local_prefill_max_tokens
            if prefill is not None and local_max and (uncached := self._uncached_tokens(
                    prompt, decode_choice.matched_blocks, decode)) <= local_max:
                prefill, local_reason = None, "short_prompt"
            self.kv_router.place(decode, prompt)
            # A prompt decode holds whole (but its last token) never reaches the prefill worker.
            if prefill is not None and decode_choice.matched_blocks < prompt.num_lookup_blocks(decode):
                self.kv_router.place(prefill, prompt)
            if span.is_recording():  # an unsampled request skips formatting what no one would read
                if prefill_choice is None:
                    prefill_reason = "no prefill worker with the decode worker's KV layout: decode prefills locally"
                elif local_reason:
                    prefill_reason = (f"{uncached} uncached prompt tokens <= local_prefill_max_tokens {local_max}: "
                                      "decode prefills locally")
                else:
                    prefill_reason = prefill_choice.reason
                span.set_attributes({
                    "tandem.route.decode": decode.address, "tandem.route.prefill": prefill.address if prefill else "",
                    "tandem.route.num_decode": len(decodes), "tandem.route.num_prefill": len(prefills),
                    "tandem.route.decode_free_blocks": decode.num_free_blocks,
                    "tandem.route.decode_queue_depth": decode.queue_depth,
                    "tandem.route.prompt_blocks": decode_choice.prompt_blocks,
                    "tandem.route.cache_aware": decode_choice.is_cache_aware,
                    "tandem.route.decode_matched_blocks": decode_choice.matched_blocks,
                    "tandem.route.prefill_matched_blocks": prefill_choice.matched_blocks if prefill_choice else 0,
                    "tandem.route.decode_candidates": _traced(decode_choice),
                    "tandem.route.prefill_candidates": _traced(prefill_choice) if prefill_choice else [],
                    "tandem.route.reason": f"decode: {decode_choice.reason}; prefill: {prefill_reason}"})
            return prefill, decode, local_reason

    @staticmethod
    def _uncached_tokens(prompt: PromptBlocks, matched_blocks: int, decode: WorkerRecord) -> int:
        """The prompt's tokens past the blocks the decode worker's prefix cache holds (as its summary says)."""
        block_size = decode.cache.block_size if decode.cache is not None else 0
        return len(prompt.token_ids) - matched_blocks * block_size

    async def _hash(self, prompt: PromptBlocks, workers: list[WorkerRecord]) -> None:
        """Hash the prompt as the workers' summaries name blocks (once per block size and key); a long prompt on
        the tokenizer's thread pool, off the event loop."""
        keys = prompt.keys_needed(workers)
        if not keys:
            return
        if prompt.num_hashed_blocks(keys) > OFFLOAD_BLOCKS:
            await self._encoder.offload(prompt.hash, keys)
        else:
            prompt.hash(keys)

    async def close(self) -> None:
        if self.pacer is not None:
            self.pacer.stop()
        for session in self._sessions.values():
            await session.close()
        await self._channels.close()
        self._encoder.close()



class _RetryableError(Exception):
    """One decode attempt failed in a way another worker may get past; `cause` is what the client gets if no
    worker is left."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class PassthroughError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# grpc.StatusCode by its number, as session updates carry it.
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _attempt_error(code: grpc.StatusCode, details: str, error_type: str = "") -> Exception:
    """What a decode worker's error means for the request: another worker may finish it (`_RetryableError`),
    or it goes to the client as is."""
    typed = typed_error(error_type, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _RetryableError(typed if isinstance(typed, OverloadedError) else OverloadedError(details))
    if code in PEER_FAILURE_CODES:
        return _RetryableError(UnavailableError(details))
    if code == grpc.StatusCode.UNAUTHENTICATED:  # the worker refused this gateway's internal token, not the client
        log.error("a decode worker refused this gateway: %s", details)
        return _RetryableError(UnavailableError(f"decode worker refused the gateway: {details}"))
    metrics.REQUESTS.labels(status=code.name.lower()).inc()
    if isinstance(typed, (InvalidRequestError, DeadlineExceededError)):
        return typed
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(details)
    return PassthroughError(code, details)


def _traced(choice: Choice) -> list[str]:
    """The cheapest candidates of a choice, for the `route` span."""
    return [f"{c.worker.address} matched={c.matched_blocks} headroom={c.headroom:.4g} cost={c.cost:.4g}"
            for c in choice.candidates[:NUM_TRACED_CANDIDATES]]


def _observe(progress: Completion) -> None:
    metrics.observe_latency(progress.time_to_first_token_s, progress.e2e_s, len(progress.token_ids))
    metrics.REQUESTS.labels(status=progress.finish_reason or "unknown").inc()



"""One decode request from arrival to its last token: backpressure, its span, admission by the scheduler, the
prompt's pages pulled from a prefill worker (or computed here), and the token stream back.

`Decode.Generate` and every request of a `Decode.Session` run through `RequestRunner.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from tandem.common.errors import OverloadedError
from tandem.decode_svc.kv_pull import FallBackLocally, KVPuller, PullRequest
from tandem.decode_svc.tracing import DecodeTraces
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine, ColumnSink, DirectTokens, RequestStream, ReservedEvent, TokenEvent
from tandem.serving.telemetry import ending
from tandem.serving.wire import finish_reason_to_proto, sampling_from_worker
from tandem.v1 import worker_pb2

# Tokens of one step handed straight to a session's next message: (token ids, logprobs).
TokenSink = Callable[[list[int], list[float]], None]


@dataclass
class _Direct:
    """A request's tokens that went to its `TokenSink`, not through its responses (counted for its metrics)."""

    sink: TokenSink
    num_tokens: int = 0


@dataclass(frozen=True)
class _PullFailed:
    """The pull ended the request with this error (delivered through the request's stream)."""

    error: Exception


class RequestRunner:
    def __init__(self, engine: AsyncEngine, puller: KVPuller, traces: DecodeTraces, max_queued: int = 1024) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.engine = engine
        self.puller = puller
        self.traces = traces
        # Backpressure: requests accepted but not yet producing tokens (waiting for admission, for their pages,
        # or for their first step) are bounded; past the bound a new one is refused with RESOURCE_EXHAUSTED.
        self.max_queued = max_queued
        self.num_queued = 0

    async def run(self, request: worker_pb2.DecodeRequest, deadline: float | None,
                  trace_carrier: Iterable[tuple[str, str | bytes]] | None, token_sink: TokenSink | None = None,
                  columns: tuple[ColumnSink, int] | None = None) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """The request's responses, inside its `decode.generate` span (continuing the caller's trace), with the
        latency metrics of the request as decode sees it. `deadline` is on `time.monotonic()`'s clock.

        With `token_sink` (a session's), the steps after the first response that carry only tokens go to it as
        they arrive, on the event loop, without waking this request's task (one task hop per token per request
        was most of decode's serving CPU per token); the first response, the last, errors and anything with
        more than tokens still come as responses, in order with the sunk tokens. With `columns` (a session's sink
        and the request's slot in it), those steps' tokens go there instead, straight from the engine thread
        (`tandem.serving.async_engine`'s docstring); `columns` wins over `token_sink`."""
        arrival = time.perf_counter()
        req_id = request.request_id
        if self.num_queued >= self.max_queued:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            raise OverloadedError(f"decode worker has {self.num_queued} requests waiting (limit {self.max_queued})")
        span = self.traces.start(req_id, len(request.prompt_token_ids), trace_carrier)
        time_to_first_token_s, num_tokens = 0.0, 0
        direct = None if token_sink is None or columns is not None else _Direct(token_sink)
        direct_tokens = None if columns is None else DirectTokens(*columns)
        self.num_queued += 1
        is_queued = True
        try:
            with ending(span):
                async with contextlib.aclosing(self._generate(request, deadline, direct, direct_tokens)) as responses:
                    async for response in responses:
                        if is_queued:
                            self.num_queued -= 1
                            is_queued = False
                        if num_tokens == 0:
                            time_to_first_token_s = time.perf_counter() - arrival
                            response.time_to_first_token_s = time_to_first_token_s
                        num_tokens += len(response.token_ids)
                        if response.finish_reason:
                            num_direct = (direct.num_tokens if direct is not None else 0) + (
                                direct_tokens.num_tokens if direct_tokens is not None else 0)
                            metrics.observe_latency(time_to_first_token_s, time.perf_counter() - arrival,
                                                    num_tokens + num_direct)
                        yield response
        finally:
            if is_queued:
                self.num_queued -= 1
            if direct_tokens is not None:
                self.traces.add_steps(req_id, *direct_tokens.take_counts())
            self.traces.finish(req_id)

    async def _generate(self, request: worker_pb2.DecodeRequest, deadline: float | None,
                        direct: _Direct | None = None, direct_tokens: DirectTokens | None = None,
                        ) -> AsyncGenerator[worker_pb2.DecodeResponse, None]:
        engine = self.engine
        req_id = request.request_id
        prompt = list(request.prompt_token_ids)
        prior = list(request.output_token_ids)  # a resumed request's tokens, already with the client
        params = sampling_from_worker(request.sampling)
        remote = bool(request.prefill_address)
        pull: asyncio.Task[None] | None = None
        admission = self.traces.child(req_id, "decode.admission") if remote else None
        with engine.stream(req_id, num_already_sent=len(prior)) as events:
            try:
                await engine.call(lambda e: e.add_request(
                    req_id, prompt, params, output_token_ids=prior, remote_prefill=remote,
                    local_prefill_reason="local" if remote else (request.local_prefill_reason or "no_prefill_worker")),
                    mid_step=True)
                if admission is not None:
                    admission.add_event("queued")  # on the engine's queue: the rest of admission is its reservation
                while True:
                    event = await events.next()
                    if isinstance(event, ReservedEvent):
                        if admission is not None:
                            admission.set_attribute("tandem.kv.blocks_reserved", len(event.block_ids))
                            admission.end()
                        pull = asyncio.create_task(self._pull(
                            PullRequest(req_id, prompt, prior, params, event.block_ids, event.num_cached_tokens),
                            request.prefill_address, deadline, events))
                        continue
                    if isinstance(event, _PullFailed):
                        raise event.error
                    assert isinstance(event, TokenEvent)
                    if direct_tokens is not None:  # the steps that went to the columns count before this one
                        self.traces.add_steps(req_id, *direct_tokens.take_counts())
                    self.traces.on_event(req_id, event)
                    # Per request per step: only the fields a decoding request's update sets (the rest read as 0).
                    response = worker_pb2.DecodeResponse(token_ids=event.token_ids, logprobs=event.logprobs)
                    if event.finish_reason:
                        response.finish_reason = finish_reason_to_proto(event.finish_reason)  # type: ignore[assignment]
                    if event.num_cached_tokens:
                        response.num_cached_tokens = event.num_cached_tokens
                    if event.local_prefill_tokens:
                        response.num_local_prefill_tokens = sum(event.local_prefill_tokens.values())
                        for reason, num_tokens in event.local_prefill_tokens.items():
                            metrics.LOCAL_PREFILL_TOKENS.labels(reason=reason).inc(num_tokens)
                    if event.finish_reason is not None:
                        # Counted before the last message goes out: the gateway cancels the call once it has it,
                        # and this generator may never resume after the `yield`.
                        metrics.REQUESTS.labels(status=event.finish_reason).inc()
                    yield response
                    if event.finish_reason is not None:
                        return
                    if direct_tokens is not None:
                        events.direct = direct_tokens
                    elif direct is not None and events.sink is None:
                        events.sink = self._sink(req_id, direct)
            finally:
                if admission is not None and admission.is_recording() and pull is None:
                    admission.end()
                if pull is not None and not pull.done():
                    pull.cancel()
                    await asyncio.gather(pull, return_exceptions=True)
                # Cancelled, failed or done: the request's blocks are free now (unless a peer may still write
                # into them: then they are freed once it has stopped).
                if req_id not in self.puller.quarantined:
                    engine.post(lambda e: e.abort(req_id))

    def _sink(self, req_id: str, direct: _Direct) -> Callable[[object], bool]:
        """Takes a step's event that carries only tokens (not the last, no prompt tokens computed, nothing
        first-message) into `direct`'s sink; anything else is left for the request's task."""
        on_event = self.traces.on_event
        sink = direct.sink

        def take(event: object) -> bool:
            if not isinstance(event, TokenEvent) or event.finish_reason is not None or event.local_prefill_tokens \
                    or event.num_cached_tokens:
                return False
            on_event(req_id, event)
            direct.num_tokens += len(event.token_ids)
            sink(event.token_ids, event.logprobs)
            return True

        return take

    async def _pull(self, request: PullRequest, address: str, deadline: float | None, events: RequestStream) -> None:
        """Fill the reserved blocks (the request then gets its first token through the engine), or have the
        prompt computed here, or end the request with the error."""
        try:
            await self.puller.pull(request, address, deadline)
        except FallBackLocally as fallback:
            reason = fallback.reason
            await self.engine.call(lambda e: e.prefill_locally(request.req_id, reason))
        except Exception as error:  # handed to the request's own task, which raises it as the request's end
            events.put_back(_PullFailed(error))

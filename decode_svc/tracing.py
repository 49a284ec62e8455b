"""Spans of the decode service, all under the request's `decode.generate` span (a child of the gateway's
`stream` span; its context arrives in the call's metadata):

- `decode.admission`: waiting for free KV blocks (remote prefill), or in the engine's queue (local);
- `kv.transfer`: the prompt's pages pulled from a prefill worker (whose `prefill` span is its child);
- `prefill.local`: the prompt computed here, when no prefill worker did it;
- `decode`: from the first token to the last, with the tokens generated and the engine steps taken.

The engine knows nothing of spans: what happened inside it arrives on each `TokenEvent` (the step's
batch size and time, the queue wait), and the spans are built here from that.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from tandem.serving.async_engine import TokenEvent
from tandem.serving.telemetry import extract_context


@dataclass
class _RequestTrace:
    span: Span  # decode.generate
    context: Context  # with `span` current: the parent of every other span of the request
    decode_span: Span | None = None
    num_tokens: int = 0
    num_steps: int = 0
    sum_batch_size: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class DecodeTraces:
    """The spans of the requests in flight, by request id (event loop only)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        self._requests: dict[str, _RequestTrace] = {}

    def start(self, req_id: str, num_prompt_tokens: int, metadata: Iterable[tuple[str, str | bytes]] | None) -> Span:
        span = self.tracer.start_span("decode.generate", context=extract_context(metadata), kind=SpanKind.SERVER,
                                      attributes={"tandem.request_id": req_id,
                                                  "tandem.prompt_tokens": num_prompt_tokens})
        if span.is_recording():  # tracing off: nothing kept
            self._requests[req_id] = _RequestTrace(span, trace.set_span_in_context(span))
        return span

    def context(self, req_id: str) -> Context | None:
        """The request's trace context, to start its child spans in and to send to a prefill worker."""
        request = self._requests.get(req_id)
        return request.context if request is not None else None

    def child(self, req_id: str, name: str) -> Span:
        """A child span of the request's `decode.generate` (a non-recording one when not traced)."""
        return self.tracer.start_span(name, context=self.context(req_id) or Context())

    def start_kv_transfer(self, req_id: str, transport: str, address: str) -> Span:
        span = self.child(req_id, "kv.transfer")
        span.set_attributes({"tandem.kv.transport": transport, "tandem.kv.peer": address})
        return span

    @staticmethod
    def kv_transferred(span: Span, num_bytes: int, num_layers: int, seconds: float) -> None:
        """The pages are in the pool. The time runs from the call to the first token, so it includes the
        prompt's compute that the layer-by-layer transfer overlaps."""
        span.set_attributes({"tandem.kv.bytes": num_bytes, "tandem.kv.layers": num_layers,
                             "tandem.kv.seconds": seconds,
                             "tandem.kv.gb_per_s": num_bytes / seconds / 1e9 if seconds > 0 else 0.0})

    def on_event(self, req_id: str, event: TokenEvent) -> None:
        request = self._requests.get(req_id)
        if request is None:
            return
        if request.decode_span is None:
            request.span.set_attribute("tandem.cached_tokens", event.num_cached_tokens)
            if event.queue_s is not None:  # the engine queued and computed the prompt itself
                self._local_prefill_spans(request, event)
            request.decode_span = self.tracer.start_span("decode", context=request.context)
        request.num_tokens += len(event.token_ids)
        request.num_draft_tokens, request.num_accepted_tokens = event.num_draft_tokens, event.num_accepted_tokens
        if event.batch_size:  # 0: the first token a prefill worker sampled, not a step of ours
            request.num_steps += 1
            request.sum_batch_size += event.batch_size
        if event.finish_reason is not None:
            request.decode_span.set_attribute("tandem.finish_reason", event.finish_reason)
            self._end_decode(request)

    def add_steps(self, req_id: str, num_tokens: int, num_steps: int, sum_batch_size: int) -> None:
        """Tokens and steps of the request that did not come as events (they went to its session's columns)."""
        request = self._requests.get(req_id)
        if request is not None:
            request.num_tokens += num_tokens
            request.num_steps += num_steps
            request.sum_batch_size += sum_batch_size

    def finish(self, req_id: str) -> None:
        """The call is over (done, failed or cancelled): end what is still open and forget the request."""
        request = self._requests.pop(req_id, None)
        if request is not None:
            self._end_decode(request)

    def _local_prefill_spans(self, request: _RequestTrace, event: TokenEvent) -> None:
        assert event.queue_s is not None
        # Placed back in time from the engine's own measures: arrival → scheduled → computed (now).
        end_ns = time.time_ns()
        scheduled_ns = end_ns - int(event.step_s * 1e9)
        arrival_ns = scheduled_ns - int(event.queue_s * 1e9)
        admission = self.tracer.start_span("decode.admission", context=request.context, start_time=arrival_ns,
                                           attributes={"tandem.queue_wait_s": event.queue_s})
        admission.end(end_time=scheduled_ns)
        prefill = self.tracer.start_span("prefill.local", context=request.context, start_time=scheduled_ns,
                                         attributes={"tandem.prompt_tokens": sum(event.local_prefill_tokens.values()),
                                                     "tandem.batch_size": event.batch_size,
                                                     "tandem.compute_s": event.step_s})
        prefill.end(end_time=end_ns)

    @staticmethod
    def _end_decode(request: _RequestTrace) -> None:
        span = request.decode_span
        if span is None or not span.is_recording():
            return
        span.set_attributes({"tandem.completion_tokens": request.num_tokens, "tandem.decode.steps": request.num_steps,
                             "tandem.batch_size.mean": request.sum_batch_size / max(1, request.num_steps),
                             "tandem.spec.draft_tokens": request.num_draft_tokens,
                             "tandem.spec.accepted_tokens": request.num_accepted_tokens,
                             "tandem.spec.acceptance": request.num_accepted_tokens / max(1, request.num_draft_tokens)})
        span.end()

"""Spans of the prefill service.

Each `Prefill` call gets a `prefill` span, a child of the decode worker's `kv.transfer` span (its
context arrives in the call's metadata). Prompts are computed in batches, and a batch belongs to no
single request's trace: each batched forward is a `prefill.batch` span of its own, linked to the
`prefill` span of every request it computed (and each of those links back to it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind

from tandem.engine.engine import StepResult
from tandem.serving.async_engine import TokenEvent
from tandem.serving.telemetry import extract_context


class PrefillTraces:
    """The `prefill` spans of the requests in flight, by request id, and the batch spans."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        # Written on the event loop, read on the engine thread (single dict operations: GIL-atomic).
        self._spans: dict[str, Span] = {}

    def start(self, req_id: str, num_prompt_tokens: int, metadata: Iterable[tuple[str, str | bytes]] | None) -> Span:
        span = self.tracer.start_span("prefill", context=extract_context(metadata), kind=SpanKind.SERVER,
                                      attributes={"tandem.request_id": req_id,
                                                  "tandem.prompt_tokens": num_prompt_tokens})
        if span.is_recording():  # tracing off: nothing to link, nothing kept
            self._spans[req_id] = span
        return span

    def first_token(self, req_id: str, event: TokenEvent, num_bytes: int, transport: str) -> None:
        """The prompt is computed: what it cost, as the engine step that computed it reports."""
        span = self._spans.get(req_id)
        if span is None:
            return
        span.set_attributes({"tandem.batch_size": event.batch_size, "tandem.compute_s": event.step_s,
                             "tandem.kv.bytes": num_bytes, "tandem.kv.transport": transport,
                             "tandem.cached_tokens": event.num_cached_tokens})
        if event.queue_s is not None:
            span.set_attribute("tandem.queue_wait_s", event.queue_s)

    def forget(self, req_id: str) -> None:
        self._spans.pop(req_id, None)

    def on_step(self, result: StepResult, seconds: float) -> None:
        """Engine thread, after a step and before its tokens are published: one span per prefill batch."""
        if not result.is_prefill:
            return
        spans = [span for request in result.requests if (span := self._spans.get(request.req_id)) is not None]
        if not spans:
            return
        end_ns = time.time_ns()
        batch = self.tracer.start_span(
            "prefill.batch", context=Context(),  # a root: the batch is part of several traces at once
            links=[Link(span.get_span_context()) for span in spans], start_time=end_ns - int(seconds * 1e9),
            attributes={"tandem.batch_size": len(result.requests),
                        "tandem.prompt_tokens": sum(result.num_new_tokens),
                        "tandem.compute_s": seconds})
        batch.end(end_time=end_ns)
        for span in spans:
            span.add_link(batch.get_span_context(), {"tandem.link": "prefill.batch"})

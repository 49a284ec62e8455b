"""Drive an `Engine` from asyncio: one engine thread steps the model; services await per-request events.

The engine is single-threaded by design (one owner of the queues and the KV tensors). Every mutation
asked by a service (add, abort, reserve, write pages, activate, release) is queued as a command and
runs on the engine thread between steps, in order. Torch releases the GIL while it computes, so the
event loop keeps serving gRPC streams during a step.

A request's steady tokens (neither its first nor its last, nothing but tokens) may skip its task altogether: with
`RequestStream.direct` set, the engine thread gathers a step's tokens of all such requests of one consumer (a decode
session) into three columns (slots, token ids, logprobs) and the event loop hands them to the consumer in one call
(`ColumnSink.add_columns`). Per request per step that costs a few list appends on the engine thread and a check on
the loop, instead of an event object, a sink call and a protobuf update (~7.5 µs of Python per token on the 2-core
CPU VM, in one process with the engine thread: a decode worker of a fast model is bound by that process's GIL).

A few commands may also run while a launched decode step is on the GPU (`call(..., mid_step=True)`: adding a
request, and the activation of one whose pages have landed), so that a request's admission and its first token do
not wait for the step in flight (a decode step of a large batch takes 10-20 ms). They run in order with everything
else: the engine thread runs the queue's head while the step computes only as long as the head may run then.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tandem.common.errors import UnavailableError
from tandem.engine.engine import Engine, StepResult
from tandem.engine.request import Request
from tandem.serving.profiling import StepProfiler

log = logging.getLogger(__name__)
T = TypeVar("T")

# While a launched step computes and no command is queued, the engine thread checks the step this often (and at
# once when a command arrives): the longest its read of a finished step is delayed, while the next one, already
# launched, keeps the GPU busy.
MID_STEP_POLL_S = 200e-6


class EngineFailure(UnavailableError):
    """Delivered to a request's stream when the engine step it was part of failed."""


@dataclass(slots=True)  # one per request per step: built on the engine thread, read on the event loop
class TokenEvent:
    """New tokens of one request; `finish_reason` set on the last event.

    The timing fields are how a request's timeline crosses from the engine to the service that traces
    it (the engine itself knows nothing of tracing): the step that made these tokens, and on the
    request's first event the time it waited in the queue before it was first scheduled.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    # Prompt tokens this engine computed for the request since its previous event, by reason.
    local_prefill_tokens: dict[str, int] = field(default_factory=dict)
    # First event only: prompt tokens found in this engine's prefix cache.
    num_cached_tokens: int = 0
    # Speculative decoding so far: proposals verified for the request, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Requests in the engine step that produced these tokens, and its wall time (0: not from a step,
    # e.g. the first token a remote prefill worker sampled).
    batch_size: int = 0
    step_s: float = 0.0
    # First event only: arrival → first scheduled, when this engine scheduled the request itself.
    queue_s: float | None = None


@dataclass
class ReservedEvent:
    """Decode role: the scheduler admitted a remote-prefill request and reserved its blocks; the first
    `num_cached_tokens` tokens' blocks came from its prefix cache (no pages needed for them)."""

    block_ids: list[int]
    num_cached_tokens: int = 0


class ColumnSink(Protocol):
    """Takes steady tokens of many requests at once, on the event loop: `token_ids[i]` and `logprobs[i]` are the next
    token of the request numbered `slots[i]` (a request with several tokens has them in order)."""

    def add_columns(self, slots: list[int], token_ids: list[int], logprobs: list[float]) -> None: ...


@dataclass(slots=True, eq=False)
class DirectTokens:
    """Where a request's steady tokens go instead of its stream: `sink`, under the request's `slot`. The counts
    (event loop only) are of the tokens and steps that went that way, for the request's metrics and trace."""

    sink: ColumnSink
    slot: int
    num_tokens: int = 0
    num_steps: int = 0
    sum_batch_size: int = 0
    # What `take_counts` handed on already.
    _taken: tuple[int, int, int] = (0, 0, 0)

    def take_counts(self) -> tuple[int, int, int]:
        """(tokens, steps, sum of batch sizes) since the last call."""
        now = (self.num_tokens, self.num_steps, self.sum_batch_size)
        taken, self._taken = self._taken, now
        return now[0] - taken[0], now[1] - taken[1], now[2] - taken[2]


@dataclass(slots=True)
class _Columns:
    """Engine thread → event loop: one step's direct tokens for one sink. `streams[i]` has `counts[i]` tokens, in
    order; `slots`, `token_ids` and `logprobs` have one entry per token."""

    streams: list[RequestStream] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class RequestStream:
    """One request's events from the engine thread (TokenEvent, ReservedEvent, or what a hook posts), in
    order. `next()` raises the EngineFailure of a failed step instead of returning it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_sent: int) -> None:
        self.loop = loop
        # A deque and the one consumer's waiter, not an asyncio.Queue: every request gets an event per step.
        self._events: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.num_sent = num_sent  # output tokens already delivered (or already with the client)
        self.first_sent = False
        self.local_prefill_sent: dict[str, int] = {}
        # Optional: takes an event on the event loop, as it arrives, instead of waking the consumer (True: taken).
        # Only offered while nothing is queued, so events stay in order; cleared when the stream closes.
        self.sink: Callable[[Any], bool] | None = None
        # Optional, set by the consumer on the event loop once its request is past its first event: the engine thread
        # then sends the steady tokens there (the module's docstring). Cleared when the stream closes.
        self.direct: DirectTokens | None = None

    async def next(self) -> Any:
        while not self._events:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = self._events.popleft()
        if isinstance(event, EngineFailure):
            raise event
        return event

    def put_back(self, event: Any) -> None:
        """Deliver `event` again after whatever is queued now (to handle it later, in order)."""
        self.deliver(event)

    def deliver(self, event: Any) -> None:
        """Event loop: hand `event` to the sink, or queue it and wake the consumer."""
        if self.sink is not None and not self._events and self.sink(event):
            return
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put(self, event: Any) -> None:
        """Any thread."""
        self.loop.call_soon_threadsafe(self.deliver, event)


class AsyncEngine:
    """Owns the engine thread. Create inside a running event loop; `close()` stops the thread."""

    def __init__(self, engine: Engine, name: str = "engine", profiler: StepProfiler | None = None) -> None:
        self.engine = engine
        # Steps to run under torch.profiler (`TANDEM_PROFILE_STEPS`), written when its range ends or at close.
        self.profiler = profiler
        # (command, may it run while a launched step computes); appended by any thread, popped by the engine thread.
        self._commands: collections.deque[tuple[Callable[[], None], bool]] = collections.deque()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._wake = threading.Event()
        # Called on the engine thread after each step, before its tokens are published (metrics, traces).
        self.on_step: Callable[[StepResult, float], None] | None = None
        engine.wait_for_step = self._wait_for_step
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- service side (event loop) -------------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], T], mid_step: bool = False) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result. `mid_step`: it may also run
        while a launched decode step computes (it must not free or write blocks a step may use: adding requests,
        reserving and activating do not)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the awaiting caller, which owns the error
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(command, mid_step)
        return await future

    def post(self, fn: Callable[[Engine], None]) -> None:
        """Fire and forget: run `fn(engine)` on the engine thread, in order with other commands."""
        self._submit(lambda: fn(self.engine))

    @contextlib.contextmanager
    def stream(self, req_id: str, num_already_sent: int = 0) -> Iterator[RequestStream]:
        """The events of `req_id` while the block runs. `num_already_sent`: output tokens the client already
        has (a resumed request's). Leaving the block stops the events; aborting the request is the caller's."""
        stream = RequestStream(asyncio.get_running_loop(), num_already_sent)
        self._streams[req_id] = stream
        try:
            yield stream
        finally:
            stream.sink = None  # events of steps already handed to the loop go nowhere now
            stream.direct = None
            if self._streams.get(req_id) is stream:
                del self._streams[req_id]

    def publish(self, request: Request, batch_size: int = 0, step_s: float = 0.0) -> None:
        """Engine thread: send the request's tokens not yet sent (and its end, if it ended), with the
        size and time of the step that made them."""
        event = self._event_for(request, batch_size, step_s)
        if event is not None:
            event[0].put(event[1])

    def _event_for(self, request: Request, batch_size: int, step_s: float
                   ) -> tuple[RequestStream, TokenEvent] | None:
        stream = self._streams.get(request.req_id)
        if stream is None:
            return None
        num_sent = stream.num_sent
        output_ids = request.output_token_ids
        finish_reason = request.finish_reason
        if len(output_ids) == num_sent and finish_reason is None:
            return None
        # Per request per step: a decoding request computed no prompt tokens, so its counts have not moved.
        local: dict[str, int] = {}
        if request.local_prefill_tokens != stream.local_prefill_sent:
            sent = stream.local_prefill_sent
            local = {reason: n - sent.get(reason, 0)
                     for reason, n in request.local_prefill_tokens.items() if n != sent.get(reason, 0)}
            stream.local_prefill_sent = dict(request.local_prefill_tokens)
        num_cached_tokens, queue_s = 0, None
        if not stream.first_sent:
            stream.first_sent = True
            num_cached_tokens = request.num_cached_tokens
            if request.first_scheduled_time is not None:
                queue_s = request.first_scheduled_time - request.arrival_time
        stream.num_sent = len(output_ids)
        return stream, TokenEvent(output_ids[num_sent:], request.output_logprobs[num_sent:], finish_reason, local,
                                  num_cached_tokens, request.num_draft_tokens, request.num_accepted_tokens,
                                  batch_size, step_s, queue_s)

    def _publish_step(self, result: StepResult, seconds: float) -> None:
        """Engine thread: every request's new tokens of a step, handed to the event loop in one wake-up
        (one `call_soon_threadsafe` per loop, not one per request: each is a write to the loop's pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, _LoopBatch] = {}
        batch_size = len(result.requests)
        streams = self._streams
        event_for = self._event_for
        for request in result.requests:
            stream = streams.get(request.req_id)
            if stream is None:
                continue
            direct = stream.direct
            if direct is not None and request.finish_reason is None and stream.first_sent \
                    and request.local_prefill_tokens == stream.local_prefill_sent:
                # A steady token (or several, with speculation): into its sink's columns.
                num_sent = stream.num_sent
                output_ids = request.output_token_ids
                num_new = len(output_ids) - num_sent
                if num_new <= 0:
                    continue
                loop_batch = by_loop.get(stream.loop)
                if loop_batch is None:
                    loop_batch = by_loop[stream.loop] = _LoopBatch(batch_size, seconds)
                columns = loop_batch.columns.get(direct.sink)
                if columns is None:
                    columns = loop_batch.columns[direct.sink] = _Columns()
                columns.streams.append(stream)
                columns.counts.append(num_new)
                if num_new == 1:
                    columns.slots.append(direct.slot)
                    columns.token_ids.append(output_ids[-1])
                    columns.logprobs.append(request.output_logprobs[-1])
                else:
                    columns.slots.extend([direct.slot] * num_new)
                    columns.token_ids.extend(output_ids[num_sent:])
                    columns.logprobs.extend(request.output_logprobs[num_sent:])
                stream.num_sent = num_sent + num_new
                continue
            event = event_for(request, batch_size, seconds)
            if event is not None:
                loop_batch = by_loop.get(stream.loop)
                if loop_batch is None:
                    loop_batch = by_loop[stream.loop] = _LoopBatch(batch_size, seconds)
                loop_batch.events.append(event)
        self._add_reserved(result.reserved, by_loop)
        _dispatch(by_loop)

    def _add_reserved(self, reserved: list[Request], by_loop: dict[asyncio.AbstractEventLoop, _LoopBatch]) -> None:
        for request in reserved:
            if (reserved_stream := self._streams.get(request.req_id)) is not None:
                by_loop.setdefault(reserved_stream.loop, _LoopBatch()).events.append(
                    (reserved_stream, ReservedEvent(list(request.block_ids), request.num_cached_tokens)))

    def _reserve_waiting(self) -> None:
        """Engine thread, between steps: reserve blocks for the remote-prefill requests at the head of the queue
        at once and tell their streams, rather than in the next step's admission (that step's time was part of
        every disaggregated request's TTFT: `decode.admission` 8.0 ms median on the H200 at 2 req/s)."""
        reserved = self.engine.reserve_waiting()
        if reserved:
            by_loop: dict[asyncio.AbstractEventLoop, _LoopBatch] = {}
            self._add_reserved(reserved, by_loop)
            _dispatch(by_loop)

    def post_event(self, req_id: str, event: Any) -> None:
        """Engine thread: hand any event to the request's stream (used by the prefill page hook)."""
        stream = self._streams.get(req_id)
        if stream is not None:
            stream.put(event)

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None], mid_step: bool = False) -> None:
        self._commands.append((command, mid_step))
        self._wake.set()

    def _wait_for_step(self, is_done: Callable[[], bool], synchronize: Callable[[], None]) -> None:
        """Engine thread, a launched step on the GPU (`Engine.wait_for_step`): until it is done, run the commands at
        the head of the queue that may run now, and the reservations they allow; once the head must wait for the
        step's end, so does everything behind it: then block on the step."""
        commands = self._commands
        while not is_done():
            if commands:
                if not commands[0][1]:
                    synchronize()
                    return
                while commands and commands[0][1]:
                    commands.popleft()[0]()
                self._reserve_waiting()
                continue
            self._wake.wait(MID_STEP_POLL_S)
            self._wake.clear()  # a command appended before this is seen by the check above

    def _run(self) -> None:
        commands = self._commands
        while not self._stopping:
            self._wake.clear()
            while commands:
                commands.popleft()[0]()
            try:
                self._reserve_waiting()
            except Exception as exc:  # as a failed step: fail what is in flight rather than strand it
                log.exception("reserving blocks failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            if not self.engine.has_unfinished():
                if self.profiler is not None:
                    self.profiler.idle()
                self._wake.wait(timeout=0.5)
                continue
            profiler = self.profiler
            if profiler is not None:
                profiler.before_step()
            start = time.perf_counter()
            try:
                result = self.engine.step()
            except Exception as exc:  # a failed step must not strand the requests waiting on it
                log.exception("engine step failed; failing the requests in flight")
                if profiler is not None:
                    profiler.after_step(time.perf_counter() - start, 0, 0)
                self._fail_all(exc)
                continue
            seconds = time.perf_counter() - start
            if profiler is not None:
                profiler.after_step(seconds, sum(result.num_new_tokens), len(result.requests))
            # The hook runs before the tokens go out, so it still sees every request of the step open
            # (a prefill stream ends, and forgets its request, as soon as it has the first token).
            if self.on_step is not None:
                self.on_step(result, seconds)
            self._publish_step(result, seconds)
            if not result.requests and not result.reserved and not self.engine.step_in_flight:
                # Nothing could run (every waiting request needs blocks that receiving requests hold): wait for a
                # command (pages, an activation, an abort) instead of spinning. (An empty result with a step
                # launched behind it, every member of the step read having been aborted, is read at once.)
                self._wake.wait(timeout=0.05)
        if self.profiler is not None:
            self.profiler.close()  # a worker stopped inside the profiled range keeps what it saw


    def _fail_all(self, error: Exception) -> None:
        failure = EngineFailure(f"engine step failed: {error}")
        streams = list(self._streams.items())
        # Everything is aborted before any stream hears of it: a client that sees the failure finds nothing held.
        for req_id in {*self.engine.requests, *(req_id for req_id, _ in streams)}:
            self.engine.abort(req_id)
        for _, stream in streams:
            stream.put(failure)


@dataclass(slots=True)
class _LoopBatch:
    """What one step hands one event loop: events for request streams, in order, and the direct tokens of each sink
    (with the size and time of the step that made them)."""

    batch_size: int = 0
    step_s: float = 0.0
    events: list[tuple[RequestStream, Any]] = field(default_factory=list)
    columns: dict[ColumnSink, _Columns] = field(default_factory=dict)


def _dispatch(by_loop: dict[asyncio.AbstractEventLoop, _LoopBatch]) -> None:
    """Engine thread: hand each loop its batch in one wake-up."""
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(_deliver_batch, batch)


def _deliver_batch(batch: _LoopBatch) -> None:
    """Event loop: the events to their streams, the direct tokens to their sinks. A stream that closed since drops its
    tokens (as its events would go nowhere); one with events still queued (they were in flight when the engine thread
    took its tokens) gets them as an event behind those, so its tokens stay in order."""
    for stream, event in batch.events:
        stream.deliver(event)
    for sink, columns in batch.columns.items():
        slots, token_ids, logprobs = columns.slots, columns.token_ids, columns.logprobs
        kept: list[int] | None = None  # the tokens' indexes that go to the sink, once one of them does not
        start = 0
        for stream, count in zip(columns.streams, columns.counts, strict=True):
            direct = stream.direct
            if direct is not None and direct.sink is sink and not stream._events:
                direct.num_tokens += count
                direct.num_steps += 1
                direct.sum_batch_size += batch.batch_size
                if kept is not None:
                    kept.extend(range(start, start + count))
            else:
                if kept is None:
                    kept = list(range(start))
                if direct is not None:  # still open: its tokens as an event, behind what it has queued
                    stream.deliver(TokenEvent(token_ids[start:start + count], logprobs[start:start + count],
                                              batch_size=batch.batch_size, step_s=batch.step_s))
            start += count
        if kept is not None:
            slots = [slots[j] for j in kept]
            token_ids = [token_ids[j] for j in kept]
            logprobs = [logprobs[j] for j in kept]
        if slots:
            sink.add_columns(slots, token_ids, logprobs)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

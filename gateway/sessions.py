"""The gateway's side of `Decode.Session`: one long-lived stream per decode worker, shared by every
request routed there.

At hundreds of concurrent requests, a call per request costs a gRPC message per token per request; in a
session the decode worker sends each step's new tokens of all its requests in one message, and the
gateway hands each request its own updates. Starting and cancelling requests are messages on the same
stream, each request's deadline and trace context ride in its start message.

A decode worker that dies ends its session (the stream breaks); one that is frozen (stopped, or its event loop
stuck) would keep it open until a keepalive ping times out, half a minute or more. So a session whose requests
are in flight while its worker has sent nothing, not even the heartbeat a live worker sends every
`SESSION_HEARTBEAT_S`, for `stall_timeout_s` is ended here, as if the stream had broken: its requests resume on
another worker.

The session's channel reads with a small fixed stream window (`SESSION_WINDOW_BYTES`) rather than one grown by BDP
probing (`SessionChannels`). With a grown window (megabytes) a gateway that falls behind its decode workers lets
their step messages pile up unread in its transport, and reads them one per event-loop turn: each request then
still gets one token per wake-up, one client message per token, and the gateway stays behind. With the fixed window
the decode worker's writer feels the lag within a few steps and merges the steps since its last message into one
(`decode_svc.sessions`), so the gateway's cost per token falls as its load rises.

On top of that transport window the session may ask for one in messages (`SESSION_ACK_WINDOW`, off by default; the
`x-tandem-session-window` metadata): the gateway acknowledges each message as it reads it, and the worker leaves
at most that many unacknowledged, so the messages it reads are never more than a message stale whatever their
size (the byte window holds ~4 steps of 256 requests' tokens, but ~30 of 32 requests').

A request's steady tokens come in the messages' token columns (`TokenColumns`, under the slot the gateway gave the
request at its start), read before the message's updates.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from tandem.common.config import env_number
from tandem.serving import metrics
from tandem.serving.rpc import ChannelPool, TlsConfig, make_channel
from tandem.serving.service import SESSION_WINDOW_KEY
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


# The session stream's receive window: a few steps of a busy worker. A step's tokens of 256 requests in columns take
# ~1.9 kB (13 kB as one update each, when the window was HTTP/2's default 64 KiB: ~5 steps). Measured on the
# gateway alone (2-core CPU VM, `stack_overhead --fake-decode-step-ms 1`, 256 × 256 tokens, two runs each): 57.1 /
# 57.7 µs of CPU per token at 8 KiB against 65.2 / 72.0 at 64 KiB (columns let that window hold ~35 steps).
SESSION_WINDOW_BYTES = 8192
# `TANDEM_SESSION_COLUMNS=0`: no slots (every token in updates) and HTTP/2's default window, as before the columns (an
# experiment's A/B switch, and a way back).
SESSION_COLUMNS = env_number("TANDEM_SESSION_COLUMNS", 1, int) != 0
# Messages of a session the decode worker may send before the gateway has acknowledged reading them (0: no acks, the
# transport's window alone); `TANDEM_SESSION_ACK_WINDOW` sets it. Off by default until measured on a GPU stack: it
# cut the gateway's CPU per token alone on the CPU VM (18.5 against 30.4 µs with 1), but each ack costs the decode
# worker's event loop a gRPC read (docs/architecture.md, "The gateway–decode session").
SESSION_ACK_WINDOW = env_number("TANDEM_SESSION_ACK_WINDOW", 0, int)
_ACK = object()  # in the outbox: send an ack of the messages read since the last one


def session_channel(address: str, tls: TlsConfig | None = None, internal_token: str | None = None,
                    ) -> grpc.aio.Channel:
    """A channel for `Decode.Session` calls: `tandem.serving.rpc.make_channel`'s (message limits, keepalive pings,
    TLS, the internal token), but with BDP probing off and a small window, so that a decode worker merges its steps
    once this gateway lags (the module's docstring says why)."""
    return make_channel(address, tls=tls, internal_token=internal_token, extra_options=(
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", SESSION_WINDOW_BYTES if SESSION_COLUMNS else 65535),
    ))


# Slots are uint32 on the wire; 0 means none. After the last one the numbers start again (a request still in flight
# four billion starts later would share its slot: not a session's lifetime at any rate served).
_MAX_SLOT = 2**32 - 1


class SessionChannels(ChannelPool):
    """One `session_channel` per decode worker, made on first use and kept while used (`ChannelPool`'s rules)."""

    def _make(self, address: str) -> grpc.aio.Channel:
        return session_channel(address, self.tls, self.internal_token)


@dataclass(frozen=True)
class SessionEnded:
    """Delivered to each request still open when its session's stream ends: the worker died, drained,
    or the stream broke. `code` and `details` are what a per-request call would have ended with."""

    code: grpc.StatusCode
    details: str


class _Tokens:
    """Steady tokens of a request that came in a message's columns (appended to while it is the last item). Read
    like a `SessionUpdate` with its `DecodeResponse` (itself): no error, no finish, nothing cached, so that
    `RequestUpdates.next()` hands a message's worth of steady tokens over as plain lists, without building a
    protobuf message per client message."""

    __slots__ = ("token_ids", "logprobs")
    error_code = 0
    error_message = ""
    error_type = ""
    finish_reason = 0
    num_cached_tokens = 0

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []

    @property
    def response(self) -> _Tokens:
        return self


Update: TypeAlias = "worker_pb2.SessionUpdate | SessionEnded"


class StreamPacer:
    """The gateway process's stream interval under load (`--max-stream-interval`): every `TICK_S` it looks how busy
    its event loop was. Saturated (the loop's thread used at least `BUSY_SHARE` of the tick's wall time in CPU, or
    the loop ran the tick's timer more than `BUSY_LAG_S` late) doubles the interval, up to `maximum`; idle (under
    `IDLE_SHARE` and less than `IDLE_LAG_S` late) halves it, down to 1. Each request's updates take the larger of it
    and the configured `--stream-interval`, so a saturated gateway sends fewer, larger client messages (a message
    costs several times a token) instead of falling further behind, and goes back to every step's tokens once it
    keeps up. The CPU share is the trigger a GPU host needs: there one gateway process ran its loop ~95% busy in
    short turns, its timers never 5 ms late (`benchmarks/results/h100-2026-12-07`); docs/architecture.md
    ("Streaming under load")."""

    TICK_S = 0.02
    BUSY_LAG_S = 0.005
    IDLE_LAG_S = 0.001
    BUSY_SHARE = 0.85
    IDLE_SHARE = 0.5

    def __init__(self, maximum: int) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be at least 1, got {maximum}")
        self.maximum = maximum
        self.interval = 1
        self._due = 0.0
        self._since = 0.0  # the loop's time and its thread's CPU time at the previous tick
        self._cpu_since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start ticking on the running loop (once; later calls do nothing)."""
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._since, self._cpu_since = loop.time(), time.thread_time()
            self._schedule(loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self.TICK_S
        self._timer = loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now, cpu = loop.time(), time.thread_time()
        lag = now - self._due
        share = (cpu - self._cpu_since) / max(now - self._since, 1e-6)
        self._since, self._cpu_since = now, cpu
        if lag > self.BUSY_LAG_S or share >= self.BUSY_SHARE:
            self.interval = min(self.interval * 2, self.maximum)
        elif lag < self.IDLE_LAG_S and share < self.IDLE_SHARE:
            self.interval = max(self.interval // 2, 1)
        metrics.GATEWAY_STREAM_INTERVAL.set(self.interval)
        self._schedule(loop)


class RequestUpdates:
    """One request's updates in its session, in order. `next()` merges the token updates already waiting into
    one, so a gateway that falls behind the engine sends each client fewer, larger messages instead of falling
    further behind (a streamed gRPC message costs the gateway far more CPU than a token). With a
    `stream_interval` of N > 1 (vLLM's and SGLang's `--stream-interval`), after the first tokens (sent at once)
    the reader is woken only once N tokens have come, or the request's end or an error: one client message, and
    one wake-up of its task, per N tokens. With a `pacer`, N is the larger of the two (`StreamPacer`)."""

    def __init__(self, stream_interval: int = 1, slot: int = 0, pacer: StreamPacer | None = None) -> None:
        self.stream_interval = stream_interval
        self.pacer = pacer
        self.slot = slot  # the request's number in its session's token columns (0: none)
        self._items: collections.deque[Update | _Tokens] = collections.deque()
        self._num_tokens = 0  # tokens in _items
        self._num_ends = 0  # ends in _items (a finish, an error or the session's end)
        self._wanted = 1  # tokens that wake a waiting reader
        self._waiter: asyncio.Future[None] | None = None
        self._streamed = False  # tokens went out already (the first ones never wait for the interval)

    def put(self, update: Update) -> None:
        self._items.append(update)
        if _is_last(update):
            self._num_ends += 1
        else:
            self._num_tokens += len(update.response.token_ids)  # type: ignore[union-attr]
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._ready(self._threshold()):
            waiter.set_result(None)

    def put_token(self, token_id: int, logprob: float) -> None:
        """A token from the session's columns."""
        items = self._items
        tokens = items[-1] if items else None
        if not isinstance(tokens, _Tokens):
            tokens = _Tokens()
            items.append(tokens)
        tokens.token_ids.append(token_id)
        tokens.logprobs.append(logprob)
        num_tokens = self._num_tokens = self._num_tokens + 1
        waiter = self._waiter
        # `_ready(_threshold())` spelled out, as this runs for every token: a reader still waiting has no end queued
        # (an end wakes it), so it is the count reaching min(wanted, max(stream interval, the pacer's)).
        if waiter is not None and (num_tokens >= self._wanted or (
                self.pacer is not None and num_tokens >= self.stream_interval
                and num_tokens >= self.pacer.interval)) and not waiter.done():
            waiter.set_result(None)

    def _threshold(self) -> int:
        """Tokens that wake the waiting reader: what it waits for, or fewer once the pacer came down since."""
        if self.pacer is None:
            return self._wanted
        return min(self._wanted, max(self.stream_interval, self.pacer.interval))

    def _ready(self, wanted: int) -> bool:
        return bool(self._items) and (wanted <= 1 or self._num_ends > 0 or self._num_tokens >= wanted)

    async def next(self) -> Update | _Tokens:
        if not self._streamed:
            wanted = 1
        elif self.pacer is None:
            wanted = self.stream_interval
        else:
            wanted = max(self.stream_interval, self.pacer.interval)
        while not self._ready(wanted):
            self._wanted = wanted
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            wanted = self._threshold()  # fewer if the pacer came down meanwhile
        update = self._take()
        if isinstance(update, _Tokens):
            if not self._items:  # the steady case: only column tokens came since the last message
                self._streamed = True
                return update
            update = _as_update(update)
        if _is_last(update):
            return update
        assert isinstance(update, worker_pb2.SessionUpdate)
        merged: worker_pb2.SessionUpdate | None = None
        while self._items and not isinstance(self._items[0], SessionEnded) and (
                isinstance(self._items[0], _Tokens) or not self._items[0].error_code):
            following = self._take()
            if merged is None:
                merged = worker_pb2.SessionUpdate()
                merged.CopyFrom(update)  # keeps the first update's first-token fields
            if isinstance(following, _Tokens):
                merged.response.token_ids.extend(following.token_ids)
                merged.response.logprobs.extend(following.logprobs)
                continue
            assert isinstance(following, worker_pb2.SessionUpdate)
            merged.response.token_ids.extend(following.response.token_ids)
            merged.response.logprobs.extend(following.response.logprobs)
            merged.response.finish_reason = following.response.finish_reason
            if following.response.finish_reason:
                break
        self._streamed = True
        return merged if merged is not None else update

    def _take(self) -> Update | _Tokens:
        update = self._items.popleft()
        if isinstance(update, _Tokens):
            self._num_tokens -= len(update.token_ids)
        elif _is_last(update):
            self._num_ends -= 1
        else:
            assert isinstance(update, worker_pb2.SessionUpdate)
            self._num_tokens -= len(update.response.token_ids)
        return update


def _as_update(tokens: _Tokens) -> worker_pb2.SessionUpdate:
    update = worker_pb2.SessionUpdate()
    update.response.token_ids.extend(tokens.token_ids)
    update.response.logprobs.extend(tokens.logprobs)
    return update


def _is_last(update: Update) -> bool:
    return isinstance(update, SessionEnded) or bool(update.error_code) or bool(update.response.finish_reason)


class DecodeSession:
    """One `Decode.Session` call. Create inside the running event loop; `closed` once its stream ended (a
    new request then needs a new session). With `stall_timeout_s`, a worker silent that long while requests
    are in flight is taken for frozen: the session ends with UNAVAILABLE."""

    def __init__(self, channel: grpc.aio.Channel, address: str, stall_timeout_s: float | None = None) -> None:
        self.address = address
        self.closed = False
        self._outbox: asyncio.Queue[worker_pb2.SessionRequest | object | None] = asyncio.Queue()
        self._requests: dict[str, RequestUpdates] = {}
        # Requests by slot (their number in the messages' token columns), and the next slot to give.
        self._slots: dict[int, RequestUpdates] = {}
        self._next_slot = 1
        loop = asyncio.get_running_loop()
        # When the worker was last heard from, or the session last went from idle to busy: silence counts only
        # while requests are in flight (an idle worker sends no heartbeats).
        self._last_heard = loop.time()
        self._stalled: SessionEnded | None = None
        self._num_unacked = 0  # messages read and not acknowledged yet (an `_ACK` is in the outbox when > 0)
        metadata = ((SESSION_WINDOW_KEY, str(SESSION_ACK_WINDOW)),) if SESSION_ACK_WINDOW > 0 else None
        self._call = worker_pb2_grpc.DecodeStub(channel).Session(self._outgoing(), metadata=metadata)
        self._reader = loop.create_task(self._read())
        self._watchdog = loop.create_task(self._watch(stall_timeout_s)) if stall_timeout_s else None

    def start(self, request: worker_pb2.DecodeRequest, timeout_s: float | None,
              trace_context: Mapping[str, str] | None = None, stream_interval: int = 1,
              pacer: StreamPacer | None = None) -> RequestUpdates:
        """Start `request` in the session; its updates (and a `SessionEnded` if the stream ends first) come
        from the returned `RequestUpdates`. Call `finish` when done with it."""
        if self.closed:
            raise RuntimeError(f"the session to {self.address} has ended")
        if not self._requests:
            self._last_heard = asyncio.get_running_loop().time()
        slot = self._next_slot if SESSION_COLUMNS else 0
        self._next_slot = slot + 1 if 0 < slot < _MAX_SLOT else 1
        updates = RequestUpdates(stream_interval, slot, pacer)
        self._requests[request.request_id] = updates
        if slot:
            self._slots[slot] = updates
        self._outbox.put_nowait(worker_pb2.SessionRequest(start=worker_pb2.SessionStart(
            request=request, timeout_s=timeout_s or 0.0, trace_context=dict(trace_context or {}), slot=slot)))
        return updates

    def finish(self, request_id: str, cancel: bool) -> None:
        """Forget the request; with `cancel`, also stop it on the worker (which frees its blocks)."""
        updates = self._requests.pop(request_id, None)
        if updates is not None and self._slots.get(updates.slot) is updates:
            del self._slots[updates.slot]
        if cancel and not self.closed:
            self._outbox.put_nowait(worker_pb2.SessionRequest(cancel=worker_pb2.SessionCancel(request_id=request_id)))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        tasks = [self._reader] if self._watchdog is None else [self._reader, self._watchdog]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _outgoing(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while (message := await self._outbox.get()) is not None:
            if message is _ACK:  # every message read since the last ack, in one
                num_messages, self._num_unacked = self._num_unacked, 0
                yield worker_pb2.SessionRequest(ack=worker_pb2.SessionAck(num_messages=num_messages))
            else:
                yield message  # type: ignore[misc]

    def _ack(self) -> None:
        if SESSION_ACK_WINDOW > 0:
            self._num_unacked += 1
            if self._num_unacked == 1:
                self._outbox.put_nowait(_ACK)

    async def _read(self) -> None:
        ended = SessionEnded(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.address} ended the session")
        loop = asyncio.get_running_loop()
        try:
            async for response in self._call:
                self._last_heard = loop.time()  # a heartbeat (no updates) counts as much as tokens
                self._ack()  # read: the worker may send the next (its tokens go to the requests below first)
                columns = response.tokens
                if columns.slots:  # before the updates: the worker puts a request's later tokens in its update
                    slots = self._slots
                    for slot, token_id, logprob in zip(columns.slots, columns.token_ids, columns.logprobs, strict=True):
                        if (updates := slots.get(slot)) is not None:  # else: cancelled by us, and forgotten
                            updates.put_token(token_id, logprob)
                for update in response.updates:
                    updates = self._requests.get(update.request_id)
                    if updates is not None:  # else: cancelled by us, and already forgotten
                        updates.put(update)
        except grpc.aio.AioRpcError as error:
            ended = SessionEnded(error.code(), f"decode worker {self.address}: {error.details()}")
            log.warning("session to %s ended: %s %s", self.address, error.code().name, error.details())
        finally:
            self.closed = True
            self._outbox.put_nowait(None)
            if self._stalled is not None:
                ended = self._stalled
            for updates in self._requests.values():
                updates.put(ended)
            self._requests.clear()
            self._slots.clear()

    async def _watch(self, stall_timeout_s: float) -> None:
        """End the session once the worker has been silent for `stall_timeout_s` with requests in flight."""
        loop = asyncio.get_running_loop()
        interval = min(stall_timeout_s / 4, 1.0)
        while not self.closed:
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            now = loop.time()
            if now - expected > interval:
                # This event loop was busy past the check itself: the worker's messages may be waiting unread, so
                # its silence is not known; look again after the reader has had its turn.
                continue
            silent_s = now - self._last_heard
            if self._requests and silent_s > stall_timeout_s:
                log.warning("decode worker %s sent nothing for %.1f s with %d requests in flight: taken for "
                            "frozen, its requests go to other workers", self.address, silent_s, len(self._requests))
                self._stalled = SessionEnded(grpc.StatusCode.UNAVAILABLE, (
                    f"decode worker {self.address} sent nothing for {silent_s:.1f} s (stall timeout "
                    f"{stall_timeout_s:g} s)"))
                self._call.cancel()
                self._reader.cancel()
                return

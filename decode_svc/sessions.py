"""The decode end of `Decode.Session`: many requests over one stream per gateway.

Each start runs as its own task (the same `RequestRunner.run` as `Decode.Generate`); a writer sends everything
that accumulated since its last message, which is one message per engine step when it keeps up and fewer,
larger ones when it does not (each request's tokens of several steps then in one update). A failed request gets
an update with its status and the others go on.

A request started with a slot has its steady tokens (after its first update) sent in the message's token columns,
straight from the engine thread (`tandem.serving.async_engine`): the gateway reads the columns before the updates,
so a request's tokens that come after one of its updates in the same message join that update instead.

A gateway that opens the session with `x-tandem-session-window: N` acknowledges every message it reads
(`SessionAck`), and the writer then keeps at most N messages unacknowledged: what comes meanwhile joins the next
one. Without it a gateway behind the engine read the transport's buffer of one-step messages, one per turn of its
event loop, each waking every request's task for one token (its CPU per token at its worst, on tokens already
stale); with it each message it reads carries all the steps since its last.

While requests are in flight, the writer also sends an empty message whenever it has sent nothing for
`SESSION_HEARTBEAT_S` (a request waiting on a long prefill, say): the gateway takes a session that stays silent
far longer for a frozen worker and moves its requests elsewhere. Heartbeats come from this writer, not from the
engine, so a worker that is only slow keeps them going, and one that is stopped stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from tandem.common.errors import TandemError
from tandem.decode_svc.generation import RequestRunner
from tandem.serving.rpc import remote_error, status_of
from tandem.serving.service import SESSION_HEARTBEAT_S
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

@dataclass(eq=False)  # hashed by identity: the servicer keeps a set of its sessions
class _Session:
    """One gateway's session: its requests in flight, and the updates not yet sent."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # The next message, filled in place (each update is copied once, into it).
    pending: worker_pb2.SessionResponse = field(default_factory=worker_pb2.SessionResponse)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # something to send, or to re-check
    # Each request's token update in `pending`: the tokens of its later steps join it (one update per request
    # per message, however many steps the message covers).
    _open: dict[str, worker_pb2.SessionUpdate] = field(default_factory=dict)
    # The same updates by slot, for requests that have one: their tokens in columns join them.
    _open_slots: dict[int, worker_pb2.SessionUpdate] = field(default_factory=dict)
    # Flow control (0: none): messages sent that the gateway has not acknowledged yet may be at most `window`.
    window: int = 0
    num_unacked: int = 0

    def acked(self, num_messages: int) -> None:
        self.num_unacked = max(self.num_unacked - num_messages, 0)
        self.ready.set()

    def is_blocked(self, reader: asyncio.Task[None]) -> bool:
        """The window is full (a gateway that stopped reading acks nothing more: then nothing holds back)."""
        return 0 < self.window <= self.num_unacked and not reader.done()

    def sent(self) -> None:
        if self.window:
            self.num_unacked += 1

    def send(self, req_id: str, response: worker_pb2.DecodeResponse, slot: int = 0) -> None:
        update = self._open.get(req_id)
        if update is None:
            update = self._open[req_id] = self.pending.updates.add(request_id=req_id, response=response)
            if slot:
                self._open_slots[slot] = update
        else:
            # Later responses carry tokens, logprobs, prompt tokens recomputed here (after a preemption) and the
            # finish; the first-message fields stay the first's.
            merged = update.response
            merged.token_ids.extend(response.token_ids)
            merged.logprobs.extend(response.logprobs)
            merged.num_local_prefill_tokens += response.num_local_prefill_tokens
            if response.finish_reason:
                merged.finish_reason = response.finish_reason
        self.ready.set()

    def send_tokens(self, req_id: str, token_ids: list[int], logprobs: list[float]) -> None:
        """A step's tokens of a request whose first response went already (`RequestRunner.run`'s token sink)."""
        update = self._open.get(req_id)
        if update is None:
            update = self._open[req_id] = self.pending.updates.add(request_id=req_id)
        update.response.token_ids.extend(token_ids)
        update.response.logprobs.extend(logprobs)
        self.ready.set()

    def add_columns(self, slots: list[int], token_ids: list[int], logprobs: list[float]) -> None:
        """Steady tokens of requests with slots (a `ColumnSink`, called on the event loop): into the message's
        columns, or into the request's update when this message has one (the module's docstring says why)."""
        columns = self.pending.tokens
        open_slots = self._open_slots
        if not open_slots:
            columns.slots.extend(slots)
            columns.token_ids.extend(token_ids)
            columns.logprobs.extend(logprobs)
        else:
            for slot, token_id, logprob in zip(slots, token_ids, logprobs, strict=True):
                update = open_slots.get(slot)
                if update is None:
                    columns.slots.append(slot)
                    columns.token_ids.append(token_id)
                    columns.logprobs.append(logprob)
                else:
                    update.response.token_ids.append(token_id)
                    update.response.logprobs.append(logprob)
        self.ready.set()

    def fail(self, req_id: str, code: grpc.StatusCode, message: str, error_type: str = "") -> None:
        self._open.pop(req_id, None)
        self.pending.updates.add(request_id=req_id, error_code=code.value[0], error_message=message,
                                 error_type=error_type)
        self.ready.set()

    def take(self) -> worker_pb2.SessionResponse | None:
        """The message to send now (None if nothing is pending)."""
        if not self.pending.updates and not self.pending.tokens.slots:
            return None
        message, self.pending = self.pending, worker_pb2.SessionResponse()
        self._open = {}
        self._open_slots = {}
        return message


class Sessions:
    def __init__(self, runner: RequestRunner) -> None:
        self.runner = runner
        self._sessions: set[_Session] = set()
        self.draining = False

    async def serve(self, requests: AsyncIterator[worker_pb2.SessionRequest], window: int = 0
                    ) -> AsyncIterator[worker_pb2.SessionResponse]:
        """The session's messages; `window` (`session_window`): how many may go unacknowledged, 0 for no limit."""
        session = _Session(window=window)
        self._sessions.add(session)
        reader = asyncio.create_task(self._read(requests, session))
        try:
            while True:
                try:
                    async with asyncio.timeout(SESSION_HEARTBEAT_S):
                        await session.ready.wait()
                except TimeoutError:
                    if session.tasks and not session.is_blocked(reader):
                        session.sent()
                        yield worker_pb2.SessionResponse()  # a heartbeat: alive, nothing new
                    continue
                session.ready.clear()
                if session.is_blocked(reader):
                    continue  # an ack (or the reader's end) sets `ready` again
                if (message := session.take()) is not None:
                    session.sent()
                    yield message
                if not session.tasks and (self.draining or reader.done()):
                    # Draining (or the gateway closed its side) and nothing left in flight. A request that ended
                    # while the message above was being written left its last updates behind: they go first.
                    if session.is_blocked(reader):
                        continue
                    if (message := session.take()) is not None:
                        session.sent()
                        yield message
                    return
        finally:
            # The gateway went away (or the worker is stopping): every request of the session ends here,
            # each freeing its blocks as a cancelled Generate call would.
            reader.cancel()
            for task in list(session.tasks.values()):
                task.cancel()
            self._sessions.discard(session)

    def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE: the gateway goes elsewhere) and end each session once its requests
        are done, so that the server's drain is not held up by idle sessions."""
        self.draining = True
        for session in self._sessions:
            session.ready.set()

    async def _read(self, requests: AsyncIterator[worker_pb2.SessionRequest], session: _Session) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "start":
                    self._start(session, message.start)
                elif kind == "ack":
                    session.acked(message.ack.num_messages)
                elif kind == "cancel" and (task := session.tasks.get(message.cancel.request_id)) is not None:
                    task.cancel()
        finally:
            session.ready.set()

    def _start(self, session: _Session, start: worker_pb2.SessionStart) -> None:
        req_id = start.request.request_id
        if self.draining:
            session.fail(req_id, grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        elif req_id in session.tasks:
            session.fail(req_id, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_id: {req_id!r} is already in flight in this session", "InvalidRequestError")
        else:
            session.tasks[req_id] = asyncio.create_task(self._run(session, start))

    async def _run(self, session: _Session, start: worker_pb2.SessionStart) -> None:
        req_id = start.request.request_id
        timeout = start.timeout_s if start.timeout_s > 0 else None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                slot = start.slot
                responses = self.runner.run(start.request, deadline, start.trace_context.items(),
                                            functools.partial(session.send_tokens, req_id),
                                            (session, slot) if slot else None)
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        session.send(req_id, response, slot)
        except TimeoutError:
            session.fail(req_id, grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded for {req_id}",
                         "DeadlineExceededError")
        except TandemError as error:
            session.fail(req_id, status_of(error), str(error), type(error).__name__)
        except grpc.aio.AioRpcError as error:  # a prefill worker's error that ends the request
            typed = remote_error(error)
            session.fail(req_id, error.code(), error.details() or "", type(typed).__name__ if typed else "")
        except Exception as error:  # a bug: this request ends with INTERNAL, the session's others go on
            log.exception("decode request %s failed", req_id)
            session.fail(req_id, grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        finally:
            session.tasks.pop(req_id, None)
            session.ready.set()

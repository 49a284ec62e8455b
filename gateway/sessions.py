"""The gateway's side of `Decode.Session`: one long-lived stream per decode worker, shared by every
request routed there.

At hundreds of concurrent requests, a call per request costs a gRPC message per token per request; in a
session the decode worker sends each step's new tokens of all its requests in one message, and the
gateway hands each request its own updates. Starting and cancelling requests are messages on the same
stream, each request's deadline and trace context ride in its start message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionEnded:
    """Delivered to each request still open when its session's stream ends: the worker died, drained,
    or the stream broke. `code` and `details` are what a per-request call would have ended with."""

    code: grpc.StatusCode
    details: str


Update = worker_pb2.SessionUpdate | SessionEnded


class DecodeSession:
    """One `Decode.Session` call. Create inside the running event loop; `closed` once its stream ended (a
    new request then needs a new session)."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self.closed = False
        self._outbox: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()
        self._requests: dict[str, asyncio.Queue[Update]] = {}
        self._call = worker_pb2_grpc.DecodeStub(channel).Session(self._outgoing())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def start(self, request: worker_pb2.DecodeRequest, timeout_s: float | None,
              trace_context: Mapping[str, str] | None = None) -> asyncio.Queue[Update]:
        """Start `request` in the session; its updates (and a `SessionEnded` if the stream ends first)
        arrive on the returned queue. Call `finish` when done with it."""
        if self.closed:
            raise RuntimeError(f"the session to {self.address} has ended")
        updates: asyncio.Queue[Update] = asyncio.Queue()
        self._requests[request.request_id] = updates
        self._outbox.put_nowait(worker_pb2.SessionRequest(start=worker_pb2.SessionStart(
            request=request, timeout_s=timeout_s or 0.0, trace_context=dict(trace_context or {}))))
        return updates

    def finish(self, request_id: str, cancel: bool) -> None:
        """Forget the request; with `cancel`, also stop it on the worker (which frees its blocks)."""
        self._requests.pop(request_id, None)
        if cancel and not self.closed:
            self._outbox.put_nowait(worker_pb2.SessionRequest(cancel=worker_pb2.SessionCancel(request_id=request_id)))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _outgoing(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        ended = SessionEnded(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.address} ended the session")
        try:
            async for response in self._call:
                for update in response.updates:
                    updates = self._requests.get(update.request_id)
                    if updates is not None:  # else: cancelled by us, and already forgotten
                        updates.put_nowait(update)
        except grpc.aio.AioRpcError as error:
            ended = SessionEnded(error.code(), f"decode worker {self.address}: {error.details()}")
            log.warning("session to %s ended: %s %s", self.address, error.code().name, error.details())
        finally:
            self.closed = True
            self._outbox.put_nowait(None)
            for updates in self._requests.values():
                updates.put_nowait(ended)
            self._requests.clear()

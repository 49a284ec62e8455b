"""The gateway's concurrency slots and its drain, shared by the gRPC and HTTP doors.

Every sequence in flight (one decode request: a gRPC `Generate` call, or one prompt × one of `n` samples of an
HTTP request) holds a slot, so `--max-concurrent-requests` bounds the decode requests the gateway has open
whatever their shape. A request takes all its slots at once or none: one with more sequences than are free is
refused at once (RESOURCE_EXHAUSTED, HTTP 429), the same as one arriving when nothing is free, so it neither
starves the others nor streams half its choices. (vLLM counts `n` against its running sequences in the same
way, and TGI against its concurrent-requests bound.)

Draining (SIGTERM) refuses new requests with UNAVAILABLE (HTTP 503) while those in flight finish.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from tandem.common.errors import OverloadedError, UnavailableError
from tandem.serving import metrics

_T = TypeVar("_T")


class Slots:
    """Slots held for one request's sequences; `create_task(coro)` runs a coroutine whose router streams use
    them instead of taking a slot of their own."""

    def __init__(self, num: int) -> None:
        self.num = num

    def create_task(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        # Set only in the task's own copy of the context: the caller's context never holds it, so a stream
        # opened anywhere else still takes its own slot.
        context = contextvars.copy_context()
        context.run(_HELD.set, self)
        return asyncio.get_running_loop().create_task(coro, context=context)


_HELD: contextvars.ContextVar[Slots | None] = contextvars.ContextVar("tandem_gateway_held_slots", default=None)


def held_slots() -> Slots | None:
    """The slots the current task's request holds already (see `Slots.create_task`), if any."""
    return _HELD.get()


class Admission:
    def __init__(self, max_sequences: int) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {max_sequences}")
        self.max_sequences = max_sequences
        self.num_active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def hold(self, num_sequences: int = 1) -> Iterator[Slots]:
        """Hold `num_sequences` slots for the duration, all or none; raises OverloadedError when they are not
        free, UnavailableError while draining."""
        if self.draining:
            raise UnavailableError("the gateway is draining (shutting down); retry on another replica")
        if self.num_active + num_sequences > self.max_sequences:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            wanted = "" if num_sequences == 1 else f" ({num_sequences} sequences asked for, {self.num_free} free)"
            raise OverloadedError(f"the gateway is at its limit of {self.max_sequences} concurrent requests"
                                  f"{wanted}; retry later")
        self.num_active += num_sequences
        self._idle.clear()
        try:
            yield Slots(num_sequences)
        finally:
            self.num_active -= num_sequences
            if self.num_active == 0:
                self._idle.set()

    @property
    def num_free(self) -> int:
        return self.max_sequences - self.num_active

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every slot to be free again; whether they are."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.num_active == 0

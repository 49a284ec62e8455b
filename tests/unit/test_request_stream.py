"""`RequestStream`'s sink: events taken as they arrive on the event loop, never ahead of queued ones, and none
after the stream closed (a step handed to the loop before a cancel must not reach the session)."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import Engine
from tandem.models import load_model_config
from tandem.serving.async_engine import AsyncEngine, RequestStream, TokenEvent


def event(token: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent([token], [-1.0], finish)


async def test_the_sink_takes_what_it_accepts_in_order() -> None:
    stream = RequestStream(asyncio.get_running_loop(), 0)
    taken: list[int] = []

    def sink(item: Any) -> bool:
        if item.finish_reason is not None:
            return False  # the last event is the consumer's
        taken.append(item.token_ids[0])
        return True

    stream.deliver(event(1))  # before a sink: queued
    stream.sink = sink
    stream.deliver(event(2))  # queued behind 1, not taken ahead of it
    assert taken == [] and (await stream.next()).token_ids == [1] and (await stream.next()).token_ids == [2]
    stream.deliver(event(3))
    stream.deliver(event(4))
    assert taken == [3, 4]
    stream.deliver(event(5, "length"))
    stream.deliver(event(6))  # behind the queued end: queued too
    assert [(await stream.next()).token_ids for _ in range(2)] == [[5], [6]] and taken == [3, 4]


async def test_no_event_reaches_the_sink_after_the_stream_closed() -> None:
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=16, num_blocks=16),
                          scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64))
    engine = AsyncEngine(Engine(config))
    taken: list[Any] = []

    def sink(item: Any) -> bool:
        taken.append(item)
        return True

    try:
        with engine.stream("r") as stream:
            stream.sink = sink
            held = stream
        held.deliver(event(7))  # what a step published before the close would do now
        assert taken == []
    finally:
        engine.close()

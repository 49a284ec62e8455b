"""A step's steady tokens in columns: from the engine thread's step (`AsyncEngine._publish_step`) through the event
loop (`_deliver_batch`) into the decode session's message (`_Session.add_columns`), and the gateway's reading of it
(`DecodeSession`, `RequestUpdates`). Every token arrives once and in order, whatever else the request's stream has
queued; a closed stream's tokens go nowhere."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from tandem.decode_svc.sessions import _Session
from tandem.gateway.sessions import RequestUpdates
from tandem.serving.async_engine import AsyncEngine, DirectTokens, RequestStream, TokenEvent, _deliver_batch, _LoopBatch
from tandem.v1 import generation_pb2, worker_pb2


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def add_columns(self, slots: list[int], token_ids: list[int], logprobs: list[float]) -> None:
        self.calls.append((slots, token_ids, logprobs))


def request(req_id: str, tokens: list[int], finish: str | None = None) -> Any:
    return types.SimpleNamespace(req_id=req_id, output_token_ids=list(tokens), output_logprobs=[-0.5] * len(tokens),
                                 finish_reason=finish, local_prefill_tokens={}, num_cached_tokens=0,
                                 first_scheduled_time=None, arrival_time=0.0, num_draft_tokens=0,
                                 num_accepted_tokens=0)


def publish(engine: AsyncEngine, requests: list[Any]) -> dict[Any, _LoopBatch]:
    """One step's publication, as the engine thread makes it (captured instead of handed to the loop)."""
    captured: list[dict[Any, _LoopBatch]] = []
    import tandem.serving.async_engine as module

    dispatch, module._dispatch = module._dispatch, captured.append  # type: ignore[assignment]
    try:
        engine._publish_step(types.SimpleNamespace(requests=requests, reserved=[]), 0.002)  # type: ignore[arg-type]
    finally:
        module._dispatch = dispatch
    return captured[0]


def engine_with(streams: dict[str, RequestStream]) -> AsyncEngine:
    engine = object.__new__(AsyncEngine)  # no engine thread: the step's publication is called directly
    engine._streams = streams
    return engine


async def test_steady_tokens_go_to_the_columns_and_the_rest_as_events() -> None:
    loop = asyncio.get_running_loop()
    sink = Sink()
    streams = {name: RequestStream(loop, 1) for name in "abcd"}
    for slot, name in enumerate("abc", start=1):
        streams[name].first_sent = True
        streams[name].direct = DirectTokens(sink, slot)
    streams["d"].first_sent = True  # no direct: its tokens come as events
    engine = engine_with(streams)
    # a: one token; b: two (speculation); c: its last token (an event: the end is the consumer's); d: no columns.
    batch = publish(engine, [request("a", [5, 6]), request("b", [5, 7, 8]), request("c", [5, 9], "length"),
                             request("d", [5, 4])])[loop]
    _deliver_batch(batch)
    assert sink.calls == [([1, 2, 2], [6, 7, 8], [-0.5, -0.5, -0.5])]
    assert streams["a"].direct.num_tokens == 1 and streams["b"].direct.num_tokens == 2  # type: ignore[union-attr]
    assert streams["b"].direct.num_steps == 1 and streams["b"].direct.sum_batch_size == 4  # type: ignore[union-attr]
    last = await streams["c"].next()
    assert last.token_ids == [9] and last.finish_reason == "length"
    assert (await streams["d"].next()).token_ids == [4]
    assert streams["a"].num_sent == 2 and streams["b"].num_sent == 3


async def test_a_stream_with_queued_events_gets_its_tokens_behind_them() -> None:
    loop = asyncio.get_running_loop()
    sink = Sink()
    queued, clean, closed = RequestStream(loop, 1), RequestStream(loop, 1), RequestStream(loop, 1)
    for slot, stream in enumerate((queued, clean, closed), start=1):
        stream.first_sent = True
        stream.direct = DirectTokens(sink, slot)
    engine = engine_with({"q": queued, "c": clean, "x": closed})
    batch = publish(engine, [request("q", [1, 2, 3]), request("c", [1, 2]), request("x", [1, 2])])[loop]
    # Before the loop runs the batch: an event of an earlier step still queued, and a stream that closed.
    queued.deliver(TokenEvent([99], [-1.0]))
    closed.direct = None
    _deliver_batch(batch)
    assert sink.calls == [([2], [2], [-0.5])]  # only the clean stream's token
    assert (await queued.next()).token_ids == [99] and (await queued.next()).token_ids == [2, 3]
    assert queued.direct.num_tokens == 0  # type: ignore[union-attr]  (its tokens came as an event, counted there)
    assert not closed._events


async def test_counts_are_handed_on_once() -> None:
    direct = DirectTokens(Sink(), 1, num_tokens=5, num_steps=4, sum_batch_size=40)
    assert direct.take_counts() == (5, 4, 40)
    direct.num_tokens += 2
    direct.num_steps += 1
    direct.sum_batch_size += 8
    assert direct.take_counts() == (2, 1, 8) and direct.take_counts() == (0, 0, 0)


def test_the_session_puts_a_request_s_tokens_in_its_update_when_the_message_has_one() -> None:
    session = _Session()
    session.send("first", worker_pb2.DecodeResponse(token_ids=[10], time_to_first_token_s=0.1), slot=1)
    session.add_columns([1, 2, 2], [11, 20, 21], [-1.0, -2.0, -2.1])
    message = session.take()
    assert message is not None
    # Slot 1's token follows its update in the message: it joins the update (the gateway reads columns first).
    assert list(message.updates[0].response.token_ids) == [10, 11]
    assert list(message.tokens.slots) == [2, 2] and list(message.tokens.token_ids) == [20, 21]
    session.add_columns([1], [12], [-1.0])  # the next message: no update of slot 1 in it, so in the columns
    message = session.take()
    assert message is not None and not message.updates and list(message.tokens.token_ids) == [12]
    assert session.take() is None


async def test_the_gateway_merges_column_tokens_with_updates_in_order() -> None:
    updates = RequestUpdates(slot=3)
    updates.put(worker_pb2.SessionUpdate(request_id="r", response=worker_pb2.DecodeResponse(
        token_ids=[1], time_to_first_token_s=0.25)))
    updates.put_token(2, -0.2)
    updates.put_token(3, -0.3)
    first = await updates.next()
    assert isinstance(first, worker_pb2.SessionUpdate)
    assert list(first.response.token_ids) == [1, 2, 3] and first.response.time_to_first_token_s == 0.25
    updates.put_token(4, -0.4)
    updates.put(worker_pb2.SessionUpdate(request_id="r", response=worker_pb2.DecodeResponse(
        token_ids=[5], logprobs=[-0.5], finish_reason=generation_pb2.FINISH_REASON_LENGTH)))
    last = await updates.next()
    assert isinstance(last, worker_pb2.SessionUpdate)
    assert list(last.response.token_ids) == [4, 5] and list(last.response.logprobs) == pytest.approx([-0.4, -0.5])
    assert last.response.finish_reason == generation_pb2.FINISH_REASON_LENGTH


async def test_column_tokens_wake_a_reader_at_the_stream_interval() -> None:
    updates = RequestUpdates(stream_interval=3, slot=1)
    updates.put(worker_pb2.SessionUpdate(request_id="r", response=worker_pb2.DecodeResponse(token_ids=[1])))
    assert list((await updates.next()).response.token_ids) == [1]  # type: ignore[union-attr]
    reader = asyncio.ensure_future(updates.next())
    updates.put_token(2, 0.0)
    updates.put_token(3, 0.0)
    await asyncio.sleep(0)
    assert not reader.done()  # two of the three tokens
    updates.put_token(4, 0.0)
    assert list((await reader).response.token_ids) == [2, 3, 4]  # type: ignore[union-attr]


async def test_steady_column_tokens_are_read_without_a_protobuf_message() -> None:
    """Only column tokens since the last read: `next()` hands them over as they were gathered (plain lists, read
    like an update with no error, finish or cached tokens); an update behind them still merges into one message."""
    updates = RequestUpdates(slot=3)
    first = worker_pb2.SessionUpdate(request_id="r")
    first.response.token_ids.append(7)
    updates.put(first)
    assert list((await updates.next()).response.token_ids) == [7]
    for token in (8, 9):
        updates.put_token(token, -0.5)
    steady = await updates.next()
    assert not isinstance(steady, worker_pb2.SessionUpdate)
    assert steady.response.token_ids == [8, 9] and steady.response.logprobs == [-0.5, -0.5]
    assert not steady.error_code and not steady.response.finish_reason and not steady.response.num_cached_tokens
    updates.put_token(10, -0.5)
    last = worker_pb2.SessionUpdate(request_id="r")
    last.response.token_ids.append(11)
    last.response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
    updates.put(last)
    merged = await updates.next()
    assert isinstance(merged, worker_pb2.SessionUpdate)
    assert list(merged.response.token_ids) == [10, 11] and merged.response.finish_reason

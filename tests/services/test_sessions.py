"""The multiplexed gateway–decode stream (`Decode.Session`), against a real decode worker pulling pages
from a real prefill worker over loopback: tokens in order per request, one end per request, several
requests per message, and one request's cancel or deadline leaving the others alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tandem.decode_svc.servicer import DecodeServicer
from tandem.decode_svc.sessions import _Session
from tandem.gateway.sessions import DecodeSession, RequestUpdates, SessionEnded, Update
from tandem.serving.rpc import make_channel
from tandem.serving.service import MAX_SESSION_WINDOW, session_window
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.factories import prompts_for
from tests.services.test_disaggregated import Worker, decode_request, reference_tokens


async def collect(updates: RequestUpdates) -> tuple[list[int], list[Update]]:
    """A request's tokens and its updates, until its last one (a finish, an error, or the session's end)."""
    tokens: list[int] = []
    seen: list[Update] = []
    while True:
        update = await updates.next()
        seen.append(update)
        if isinstance(update, SessionEnded) or update.error_code:
            return tokens, seen
        tokens += update.response.token_ids
        if update.response.finish_reason:
            return tokens, seen


async def wait_all_blocks_free(worker: Worker) -> None:
    engine = worker.engine.engine
    for _ in range(200):
        if engine.num_free_blocks == engine.num_total_blocks:
            break
        await asyncio.sleep(0.01)
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.block_pool.check_integrity()


async def test_each_request_gets_its_tokens_in_order_and_one_end(workers: tuple[Worker, Worker], model_folder: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = workers
    sunk: dict[int, int] = {}  # by slot: tokens the engine thread handed straight to the session's columns
    add_columns = _Session.add_columns

    def spy(session: _Session, slots: list[int], token_ids: list[int], logprobs: list[float]) -> None:
        for slot in slots:
            sunk[slot] = sunk.get(slot, 0) + 1
        add_columns(session, slots, token_ids, logprobs)

    monkeypatch.setattr(_Session, "add_columns", spy)
    prompts = prompts_for(512, [3, 17, 29, 8, 40, 11])
    lengths = [12, 5, 9, 12, 3, 7]  # different lengths: requests end while others go on
    channel = make_channel(decode.address)
    session = DecodeSession(channel, decode.address)
    queues = [session.start(decode_request(f"s{i}", p, prefill.address, max_tokens=n), None)
              for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    slot_lengths = {q.slot: n for q, n in zip(queues, lengths, strict=True)}
    results = await asyncio.gather(*(collect(q) for q in queues))
    for i, (tokens, seen) in enumerate(results):
        assert tokens == reference_tokens(model_folder, [prompts[i]], max_tokens=lengths[i])[0]
        # Exactly one end, and it is the last update; nothing failed.
        assert [bool(u.response.finish_reason) for u in seen] == [False] * (len(seen) - 1) + [True]
        assert all(not isinstance(u, SessionEnded) and u.error_code == 0 for u in seen)
        session.finish(f"s{i}", cancel=False)
    # The steps between a request's first response and its last went to the session's columns.
    # (Its first and last tokens come as responses, so each sank fewer than it made.)
    assert sum(sunk.values()) > 0 and all(n <= slot_lengths[slot] - 2 for slot, n in sunk.items()), sunk
    assert not session.closed  # the session outlives its requests, for the next ones
    tokens, _ = await collect(session.start(decode_request("later", prompts[0], prefill.address), None))
    assert tokens == results[0][0]
    await session.close()
    await channel.close()
    await wait_all_blocks_free(decode)


async def test_one_message_carries_many_requests_tokens(workers: tuple[Worker, Worker]) -> None:
    """The point of the session: a step's tokens of all requests travel together."""
    prefill, decode = workers
    num_requests, max_tokens = 8, 16
    starts = [worker_pb2.SessionRequest(start=worker_pb2.SessionStart(
        request=decode_request(f"m{i}", p, prefill.address, max_tokens=max_tokens)))
        for i, p in enumerate(prompts_for(512, [5 + 3 * i for i in range(num_requests)]))]
    done = asyncio.Event()

    async def outgoing() -> AsyncIterator[worker_pb2.SessionRequest]:
        for start in starts:
            yield start
        await done.wait()  # half-closing now would end the session as soon as it is idle

    channel = make_channel(decode.address)
    call = worker_pb2_grpc.DecodeStub(channel).Session(outgoing())
    num_messages, tokens, ended = 0, dict.fromkeys(range(num_requests), 0), set()
    async for response in call:
        num_messages += 1
        for update in response.updates:
            index = int(update.request_id[1:])
            tokens[index] += len(update.response.token_ids)
            if update.response.finish_reason:
                ended.add(index)
        if len(ended) == num_requests:
            break
    done.set()
    call.cancel()
    await channel.close()
    assert tokens == dict.fromkeys(range(num_requests), max_tokens)
    # One message per token per request would be num_requests * max_tokens messages.
    assert num_messages <= num_requests * max_tokens // 2, num_messages


async def test_a_session_window_holds_messages_until_the_gateway_acks(workers: tuple[Worker, Worker],
                                                                      model_folder: Path) -> None:
    """With `x-tandem-session-window: 1` the worker sends nothing more until the last message is acknowledged, and
    what came meanwhile arrives merged into the next message; every token still arrives, in order."""
    prefill, decode = workers
    prompts = prompts_for(512, [6, 13, 21])
    max_tokens = 12
    outbox: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()
    for i, prompt in enumerate(prompts):
        outbox.put_nowait(worker_pb2.SessionRequest(start=worker_pb2.SessionStart(
            request=decode_request(f"w{i}", prompt, prefill.address, max_tokens=max_tokens))))

    async def outgoing() -> AsyncIterator[worker_pb2.SessionRequest]:
        while (message := await outbox.get()) is not None:
            yield message

    def ack() -> None:
        outbox.put_nowait(worker_pb2.SessionRequest(ack=worker_pb2.SessionAck(num_messages=1)))

    channel = make_channel(decode.address)
    call = worker_pb2_grpc.DecodeStub(channel).Session(outgoing(), metadata=(("x-tandem-session-window", "1"),))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    ended: set[int] = set()

    def take(response: worker_pb2.SessionResponse) -> int:
        for update in response.updates:
            index = int(update.request_id[1:])
            tokens[index] += update.response.token_ids
            if update.response.finish_reason:
                ended.add(index)
        return sum(len(u.response.token_ids) for u in response.updates)

    take(await call.read())
    # Not acknowledged: nothing more comes, however many steps the engine makes meanwhile.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(read := asyncio.ensure_future(call.read())), timeout=0.5)
    ack()
    merged = take(await read)
    assert merged >= 2  # the steps made while the window was full, in one message
    num_messages = 2
    while len(ended) < len(prompts):
        ack()
        take(await call.read())
        num_messages += 1
    outbox.put_nowait(None)
    call.cancel()
    await channel.close()
    assert [tokens[i] for i in range(len(prompts))] == reference_tokens(model_folder, prompts, max_tokens=max_tokens)
    assert num_messages < len(prompts) * max_tokens


async def test_the_gateway_acks_what_it_reads_and_gets_every_token(workers: tuple[Worker, Worker], model_folder: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`TANDEM_SESSION_ACK_WINDOW=1` on the gateway: its session asks for the window, acknowledges every message, and
    the worker never has more than one unacknowledged; every request's tokens are the reference's."""
    prefill, decode = workers
    monkeypatch.setattr("tandem.gateway.sessions.SESSION_ACK_WINDOW", 1)
    most_unacked: list[int] = []
    sent = _Session.sent

    def spy(session: _Session) -> None:
        sent(session)
        most_unacked.append(session.num_unacked if session.window else -1)

    monkeypatch.setattr(_Session, "sent", spy)
    prompts = prompts_for(512, [4, 19, 27, 10])
    lengths = [10, 6, 12, 3]
    channel = make_channel(decode.address)
    session = DecodeSession(channel, decode.address)
    queues = [session.start(decode_request(f"a{i}", p, prefill.address, max_tokens=n), None)
              for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    results = await asyncio.gather(*(collect(q) for q in queues))
    for i, (tokens, _) in enumerate(results):
        assert tokens == reference_tokens(model_folder, [prompts[i]], max_tokens=lengths[i])[0]
        session.finish(f"a{i}", cancel=False)
    assert most_unacked and max(most_unacked) == 1  # windowed (not -1), and never two in flight
    await session.close()
    await channel.close()


def test_the_session_window_from_metadata() -> None:
    assert session_window(None) == 0
    assert session_window([("x-tandem-session-window", "2"), ("other", "5")]) == 2
    assert session_window([("x-tandem-session-window", "two")]) == 0  # not a count: no window
    assert session_window([("x-tandem-session-window", "100000")]) == MAX_SESSION_WINDOW
    assert session_window([("x-tandem-session-window", "-3")]) == 0


async def test_cancelling_one_request_leaves_the_others_alone(workers: tuple[Worker, Worker],
                                                              model_folder: Path) -> None:
    prefill, decode = workers
    prompts = prompts_for(512, [9, 14, 21])
    channel = make_channel(decode.address)
    session = DecodeSession(channel, decode.address)
    queues = [session.start(decode_request(f"k{i}", p, prefill.address, max_tokens=40), None)
              for i, p in enumerate(prompts)]
    first = await queues[1].next()
    assert not isinstance(first, SessionEnded) and first.response.token_ids
    session.finish("k1", cancel=True)
    results = await asyncio.gather(collect(queues[0]), collect(queues[2]))
    expected = reference_tokens(model_folder, [prompts[0], prompts[2]], max_tokens=40)
    assert [tokens for tokens, _ in results] == expected
    await wait_all_blocks_free(decode)  # the cancelled request's blocks too
    assert not session.closed
    await session.close()
    await channel.close()


async def test_a_request_deadline_ends_only_that_request(workers: tuple[Worker, Worker],
                                                         model_folder: Path) -> None:
    prefill, decode = workers
    prompts = prompts_for(512, [12, 6])
    channel = make_channel(decode.address)
    session = DecodeSession(channel, decode.address)
    # A deadline that passes at once: the worker ends the request with DEADLINE_EXCEEDED.
    doomed = session.start(decode_request("d0", prompts[0], prefill.address, max_tokens=100), 1e-6)
    fine = session.start(decode_request("d1", prompts[1], prefill.address), None)
    _, seen = await collect(doomed)
    last = seen[-1]
    assert not isinstance(last, SessionEnded)
    assert _status(last.error_code) == grpc.StatusCode.DEADLINE_EXCEEDED
    tokens, _ = await collect(fine)
    assert tokens == reference_tokens(model_folder, [prompts[1]])[0]
    await session.close()
    await channel.close()
    await wait_all_blocks_free(decode)


async def test_drain_refuses_new_requests_and_ends_the_idle_session(workers: tuple[Worker, Worker],
                                                                    model_folder: Path) -> None:
    prefill, decode = workers
    prompt = prompts_for(512, [10])[0]
    channel = make_channel(decode.address)
    session = DecodeSession(channel, decode.address)
    running = session.start(decode_request("r", prompt, prefill.address, max_tokens=30), None)
    await running.next()  # under way
    assert isinstance(decode.servicer, DecodeServicer)
    decode.servicer.drain()
    _, refused = await collect(session.start(decode_request("new", prompt, prefill.address), None))
    assert not isinstance(refused[-1], SessionEnded)
    assert _status(refused[-1].error_code) == grpc.StatusCode.UNAVAILABLE
    tokens, seen = await collect(running)  # the request in flight finishes
    assert seen[-1].response.finish_reason  # type: ignore[union-attr]
    for _ in range(200):  # then the worker ends the session
        if session.closed:
            break
        await asyncio.sleep(0.01)
    assert session.closed
    await session.close()
    await channel.close()


def _status(number: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == number)


async def test_updates_waiting_are_merged_up_to_an_end() -> None:
    """A gateway that fell behind sends a request's waiting tokens in one message; an error or the session's
    end is never merged away."""
    updates = RequestUpdates()

    def tokens(ids: list[int], finish: int = 0, ttft: float = 0.0) -> worker_pb2.SessionUpdate:
        return worker_pb2.SessionUpdate(request_id="r", response=worker_pb2.DecodeResponse(
            token_ids=ids, logprobs=[-float(i) for i in ids], finish_reason=finish, time_to_first_token_s=ttft))

    for update in (tokens([1, 2], ttft=0.5), tokens([3]), tokens([4], finish=1), tokens([5])):
        updates.put(update)
    merged = await updates.next()
    assert isinstance(merged, worker_pb2.SessionUpdate)
    assert list(merged.response.token_ids) == [1, 2, 3, 4]
    assert list(merged.response.logprobs) == [-1.0, -2.0, -3.0, -4.0]
    assert merged.response.finish_reason == 1 and merged.response.time_to_first_token_s == 0.5
    assert list((await updates.next()).response.token_ids) == [5]  # type: ignore[union-attr]

    failed = worker_pb2.SessionUpdate(request_id="r", error_code=grpc.StatusCode.INTERNAL.value[0])
    ended = SessionEnded(grpc.StatusCode.UNAVAILABLE, "gone")
    for update in (tokens([6]), tokens([7]), failed, tokens([8]), ended):
        updates.put(update)
    assert list((await updates.next()).response.token_ids) == [6, 7]  # type: ignore[union-attr]
    assert await updates.next() == failed
    assert list((await updates.next()).response.token_ids) == [8]  # type: ignore[union-attr]
    assert await updates.next() == ended


def test_a_message_holds_one_update_per_request_however_many_steps() -> None:
    """Decode's writer: the steps a message covers join each request's one update (tokens, logprobs in order, the
    first step's first-message fields, the finish); an error is an update of its own, never merged into."""
    session = _Session()

    def step(ids: list[int], finish: int = 0, ttft: float = 0.0) -> worker_pb2.DecodeResponse:
        return worker_pb2.DecodeResponse(token_ids=ids, logprobs=[-float(i) for i in ids], finish_reason=finish,
                                         time_to_first_token_s=ttft, num_local_prefill_tokens=7 if ttft else 0)

    session.send("a", step([1], ttft=0.25))
    session.send("b", step([10]))
    session.send("a", step([2, 3]))
    session.send_tokens("a", [4], [-4.0])  # a step's tokens from the request's token sink
    session.send("a", worker_pb2.DecodeResponse(token_ids=[5], logprobs=[-5.0], num_local_prefill_tokens=3))
    session.send("b", step([11], finish=2))
    message = session.take()
    assert message is not None and [u.request_id for u in message.updates] == ["a", "b"]
    a, b = (u.response for u in message.updates)
    assert list(a.token_ids) == [1, 2, 3, 4, 5] and list(a.logprobs) == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert a.time_to_first_token_s == 0.25 and a.num_local_prefill_tokens == 7 + 3 and a.finish_reason == 0
    assert list(b.token_ids) == [10, 11] and b.finish_reason == 2
    assert session.take() is None

    session.send_tokens("a", [4], [-4.0])  # a new message starts a new update
    session.fail("a", grpc.StatusCode.INTERNAL, "boom")
    session.send("c", step([20]))
    message = session.take()
    assert message is not None and [(u.request_id, u.error_code) for u in message.updates] == [
        ("a", 0), ("a", grpc.StatusCode.INTERNAL.value[0]), ("c", 0)]
    assert list(message.updates[0].response.token_ids) == [4]


async def test_a_stream_interval_sends_the_first_tokens_at_once_then_every_n() -> None:
    """--stream-interval 3: the first update goes alone (time to first token), later ones wait until 3 tokens
    have come, and the finish or an error is never held back."""
    updates = RequestUpdates(stream_interval=3)

    def tokens(ids: list[int], finish: int = 0) -> worker_pb2.SessionUpdate:
        return worker_pb2.SessionUpdate(request_id="r", response=worker_pb2.DecodeResponse(
            token_ids=ids, logprobs=[-float(i) for i in ids], finish_reason=finish))

    async def feed(*items: Update) -> None:
        for item in items:
            await asyncio.sleep(0.01)  # one engine step each: nothing waiting when `next` looks
            updates.put(item)

    got: list[list[int]] = []
    feeder = asyncio.create_task(feed(tokens([1]), tokens([2]), tokens([3]), tokens([4]), tokens([5, 6]),
                                      tokens([7]), tokens([8], finish=1)))
    while True:
        update = await updates.next()
        assert isinstance(update, worker_pb2.SessionUpdate)
        got.append(list(update.response.token_ids))
        assert len(update.response.logprobs) == len(got[-1])
        if update.response.finish_reason:
            break
    await feeder
    assert got == [[1], [2, 3, 4], [5, 6, 7], [8]]

    # An error ends the wait; what came before it goes first.
    failed = worker_pb2.SessionUpdate(request_id="r", error_code=grpc.StatusCode.INTERNAL.value[0])
    feeder = asyncio.create_task(feed(tokens([9]), failed))
    assert list((await updates.next()).response.token_ids) == [9]  # type: ignore[union-attr]
    assert await updates.next() == failed
    await feeder

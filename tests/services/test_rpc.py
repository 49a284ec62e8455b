"""shared/rpc.py against a real in-process grpc.aio server: health, reflection, error mapping, limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.common.errors import InvalidRequestError, LayoutMismatchError, OverloadedError, UnavailableError
from tandem.serving.rpc import make_channel, start_server, stop_server
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

_BIG = 10 * 1024 * 1024  # over gRPC's default 4 MiB receive limit

# What each trigger prompt makes the handlers raise.
_ERRORS: dict[str, Exception] = {
    "invalid": InvalidRequestError("sampling.top_p", "must be in (0, 1], got 2.0"),
    "overloaded": OverloadedError("queue full (64 waiting)"),
    "unavailable": UnavailableError("no decode worker"),
    "layout": LayoutMismatchError("block_size 16 != 32"),
    "bug": RuntimeError("a bug"),
}
_EXPECTED_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "layout": grpc.StatusCode.FAILED_PRECONDITION,
    "bug": grpc.StatusCode.UNKNOWN,
}


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Raises on trigger prompts; streams by `yield`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()  # set when a "slow" stream's handler waits for release
        self.closed = asyncio.Event()  # set when a "slow" stream's handler has cleaned up

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        if request.prompt in _ERRORS:
            raise _ERRORS[request.prompt]
        return generation_pb2.TokenizeResponse(token_ids=[len(request.prompt)])

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        yield generation_pb2.GenerateResponse(request_id=request.request_id, text="first")
        if request.prompt == "slow":
            try:
                self.waiting.set()
                await self.release.wait()
            finally:
                self.closed.set()
        elif request.prompt == "big":
            yield generation_pb2.GenerateResponse(text="x" * _BIG)
        elif request.prompt in _ERRORS:
            raise _ERRORS[request.prompt]
        yield generation_pb2.GenerateResponse(finish_reason=generation_pb2.FINISH_REASON_STOP)


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """Streams through `context.write` (a coroutine handler, not a generator)."""

    async def Generate(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> None:
        await context.write(worker_pb2.DecodeResponse(token_ids=[1]))
        raise OverloadedError("out of KV blocks")


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeGeneration, grpc.aio.Channel, grpc.aio.Server, object]]:
    generation = FakeGeneration()

    def add_servicers(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
        worker_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(), server)
        return ["tandem.v1.Generation", "tandem.v1.Decode"]

    server, port, health = await start_server("127.0.0.1:0", add_servicers)
    assert port > 0
    channel = make_channel(f"127.0.0.1:{port}")
    yield generation, channel, server, health
    generation.release.set()
    await channel.close()
    await server.stop(None)


async def test_health_reports_each_service(served) -> None:
    _, channel, _, _ = served
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Generation", "tandem.v1.Decode"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_services(served) -> None:
    _, channel, _, _ = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    replies = [reply async for reply in call]
    names = {service.name for service in replies[0].list_services_response.service}
    assert names == {
        "tandem.v1.Generation",
        "tandem.v1.Decode",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


@pytest.mark.parametrize("trigger", sorted(_ERRORS))
async def test_unary_errors_map_to_status(served, trigger: str) -> None:
    _, channel, _, _ = served
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(generation_pb2.TokenizeRequest(prompt=trigger))
    assert info.value.code() == _EXPECTED_CODES[trigger]
    if trigger != "bug":
        assert info.value.details() == str(_ERRORS[trigger])


async def test_invalid_request_names_the_field(served) -> None:
    _, channel, _, _ = served
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(generation_pb2.TokenizeRequest(prompt="invalid"))
    assert info.value.details() == "sampling.top_p: must be in (0, 1], got 2.0"


@pytest.mark.parametrize("trigger", sorted(_ERRORS))
async def test_stream_error_after_first_message(served, trigger: str) -> None:
    _, channel, _, _ = served
    stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(generation_pb2.GenerateRequest(request_id="r1", prompt=trigger))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for reply in call:
            received.append(reply)
    assert [reply.text for reply in received] == ["first"]
    assert received[0].request_id == "r1"
    assert info.value.code() == _EXPECTED_CODES[trigger]


async def test_stream_without_error_completes(served) -> None:
    _, channel, _, _ = served
    stub = generation_pb2_grpc.GenerationStub(channel)
    replies = [reply async for reply in stub.Generate(generation_pb2.GenerateRequest(prompt="hello"))]
    assert [reply.finish_reason for reply in replies] == [
        generation_pb2.FINISH_REASON_UNSPECIFIED,
        generation_pb2.FINISH_REASON_STOP,
    ]


async def test_write_style_stream_errors_map_too(served) -> None:
    _, channel, _, _ = served
    call = worker_pb2_grpc.DecodeStub(channel).Generate(worker_pb2.DecodeRequest(request_id="r"))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for reply in call:
            received.append(list(reply.token_ids))
    assert received == [[1]]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "out of KV blocks"


async def test_messages_over_grpc_default_limit_pass_both_ways(served) -> None:
    _, channel, _, _ = served
    stub = generation_pb2_grpc.GenerationStub(channel)
    reply = await stub.Tokenize(generation_pb2.TokenizeRequest(prompt="y" * _BIG))
    assert list(reply.token_ids) == [_BIG]
    replies = [reply async for reply in stub.Generate(generation_pb2.GenerateRequest(prompt="big"))]
    assert len(replies[1].text) == _BIG


async def test_client_cancel_runs_the_handlers_clean_up(served) -> None:
    generation, channel, _, _ = served
    call = generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(prompt="slow"))
    assert (await call.read()).text == "first"
    await asyncio.wait_for(generation.waiting.wait(), timeout=5.0)
    call.cancel()
    await asyncio.wait_for(generation.closed.wait(), timeout=5.0)


async def test_stop_server_drains_calls_in_flight(served) -> None:
    generation, channel, server, health = served
    stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(generation_pb2.GenerateRequest(prompt="slow"))
    first = await call.read()
    assert first.text == "first"
    stopping = asyncio.create_task(stop_server(server, health, grace_s=10.0))
    await asyncio.sleep(0.2)
    assert not stopping.done(), "stop_server must wait for the call in flight"
    generation.release.set()
    last = await call.read()
    assert last.finish_reason == generation_pb2.FINISH_REASON_STOP
    await asyncio.wait_for(stopping, timeout=10.0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(generation_pb2.TokenizeRequest(prompt="x"), timeout=2.0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_burst_past_grpc_cores_call_backlog_reaches_the_handlers() -> None:
    """gRPC core refuses new calls past a backlog of calls the server's loop has not taken yet (1,000 by default,
    random early drop up to 3,000): the client saw CANCELLED before any handler, or limit of ours, saw the call.
    A burst of 2,500 streams on one connection (the transport allowing that many) now reaches the handlers."""
    generation = FakeGeneration()

    def add_servicers(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
        return ["tandem.v1.Generation"]

    server, port, _ = await start_server("127.0.0.1:0", add_servicers, max_concurrent_streams=4096)
    channel = make_channel(f"127.0.0.1:{port}")
    stub = generation_pb2_grpc.GenerationStub(channel)

    async def one(i: int) -> str:
        try:
            texts = [r.text async for r in stub.Generate(generation_pb2.GenerateRequest(request_id=str(i)),
                                                         timeout=60)]
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return "ok" if texts[0] == "first" else "short"

    try:
        assert await one(-1) == "ok"  # connected: the burst goes over this one connection
        outcomes = await asyncio.gather(*(one(i) for i in range(2500)))
    finally:
        await channel.close()
        await server.stop(None)
    assert {outcome: outcomes.count(outcome) for outcome in set(outcomes)} == {"ok": 2500}


async def test_a_channel_pool_closes_a_channel_left_failing_and_keeps_a_live_one() -> None:
    """A pool's channel to an address nothing listens on (a worker that went away), unused for `idle_close_s` and
    failing to connect, is closed at the pool's next `get`; an idle channel to a live server stays, and asking for
    the dead address again makes a fresh channel."""
    from tandem.launcher import free_port
    from tandem.serving.rpc import ChannelPool

    server, port, health = await start_server("127.0.0.1:0", lambda server: [])
    live_address = f"127.0.0.1:{port}"
    pool = ChannelPool()
    pool.idle_close_s = 0.2
    try:
        dead_address = f"127.0.0.1:{free_port('127.0.0.1')}"
        dead = pool.get(dead_address)
        live = pool.get(live_address)
        await asyncio.wait_for(live.channel_ready(), 5)
        dead.get_state(try_to_connect=True)
        for _ in range(100):
            if dead.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the channel to nothing never failed")
        await asyncio.sleep(0.3)
        pool.get("127.0.0.1:1")  # any get sweeps once idle_close_s has passed
        assert dead_address not in pool and live_address in pool
        assert pool.get(live_address) is live
        assert pool.get(dead_address) is not dead
    finally:
        await pool.close()
        await stop_server(server, health, 0)

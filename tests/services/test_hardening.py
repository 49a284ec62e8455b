"""The gateway hardened, as a whole (`tandem.gateway.server.serve` in-process, real gRPC and HTTP on loopback)
over fast fake decode workers: hundreds of streams over one client connection, drain covering HTTP, a frozen
decode worker's requests resumed elsewhere token-exact, malformed and oversized gRPC requests refused naming the
field; and a real decode worker's heartbeats keeping a request that waits on a slow prefill alive.
`FakeDecode` and `running_gateway` are shared with `test_hardening_fuzz.py`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx2
import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.gateway.limits import GatewayLimits
from tandem.gateway.router import Router
from tandem.gateway.server import load_gateway_model, serve
from tandem.prefill_svc.servicer import add_to_server as add_prefill_to_server
from tandem.serving.registry import StaticRegistry
from tandem.serving.rpc import make_channel, start_server
from tandem.serving.service import SESSION_HEARTBEAT_S, ServiceOptions
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services.test_reliability import Worker, start_worker
from tests.unit.test_limits import fake_token

MODEL = "dummy:tiny"  # the gateway loads only its tokenizer; the fake workers compute nothing


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """A decode worker that answers at once: each started request streams `fake_token`s (`delay_s` apart) to
    its max_tokens, resuming after `output_token_ids` as a real worker does, with heartbeats while it has
    requests in flight. `freeze()` makes it fall silent, as a stopped process would, with its connection up."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.frozen = False
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def freeze(self) -> None:
        self.frozen = True

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        if self.frozen:
            await asyncio.Event().wait()
        return worker_pb2.WorkerInfo(role="decode", model=MODEL, layout=worker_pb2.KVLayout(model_fingerprint="fake"),
                                     num_free_blocks=1000, num_total_blocks=1000, max_model_len=2048,
                                     vocab_size=49152)

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SessionResponse]:
        out: asyncio.Queue[worker_pb2.SessionUpdate] = asyncio.Queue()
        tasks: dict[str, asyncio.Task[None]] = {}

        async def run(request: worker_pb2.DecodeRequest) -> None:
            prompt = list(request.prompt_token_ids)
            for position in range(len(request.output_token_ids), request.sampling.max_tokens):
                await asyncio.sleep(self.delay_s)
                response = worker_pb2.DecodeResponse(token_ids=[fake_token(prompt, position)], logprobs=[-1.0])
                if position == request.sampling.max_tokens - 1:
                    response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                out.put_nowait(worker_pb2.SessionUpdate(request_id=request.request_id, response=response))
            tasks.pop(request.request_id, None)

        async def read() -> None:
            async for message in requests:
                if message.WhichOneof("kind") == "start":
                    self.started.append(message.start.request.request_id)
                    request_id = message.start.request.request_id
                    tasks[request_id] = asyncio.ensure_future(run(message.start.request))
                elif (task := tasks.pop(message.cancel.request_id, None)) is not None:
                    self.cancelled.append(message.cancel.request_id)
                    task.cancel()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                try:
                    async with asyncio.timeout(SESSION_HEARTBEAT_S):
                        update = await out.get()
                except TimeoutError:
                    update = None
                while self.frozen:
                    await asyncio.sleep(3600)
                if update is None:
                    if tasks:
                        yield worker_pb2.SessionResponse()
                    continue
                updates = [update]
                while not out.empty():
                    updates.append(out.get_nowait())
                yield worker_pb2.SessionResponse(updates=updates)
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()


@dataclass
class FakeWorker:
    servicer: FakeDecode
    server: grpc.aio.Server
    address: str


async def start_fake_decode() -> FakeWorker:
    servicer = FakeDecode()

    def register(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        return ["tandem.v1.Decode"]

    server, port, _ = await start_server("127.0.0.1:0", register)
    return FakeWorker(servicer, server, f"127.0.0.1:{port}")


@dataclass
class RunningGateway:
    grpc: str
    http: str
    stop: asyncio.Event
    task: asyncio.Task[None]
    decodes: list[FakeWorker] = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_gateway(num_decode: int = 1, limits: GatewayLimits | None = None, drain_s: float = 10.0,
                          workers: tuple[list[str], list[str]] | None = None,
                          **kwargs: Any) -> AsyncIterator[RunningGateway]:
    """`tandem gateway` in this process (the same `serve`), over `num_decode` fake decode workers, or over the
    real (prefill, decode) `workers` given."""
    decodes = [await start_fake_decode() for _ in range(num_decode if workers is None else 0)]
    prefill_addresses, decode_addresses = workers or ([], [d.address for d in decodes])
    stop = asyncio.Event()
    started: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    service = ServiceOptions(role="gateway", port=0, http_port=0, drain_s=drain_s)
    task = asyncio.ensure_future(serve(service, MODEL, prefill_addresses, decode_addresses, limits=limits,
                                       on_started=lambda address, http: started.set_result((address, http)),
                                       stop=stop, **kwargs))
    try:
        done, _ = await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises what stopped it
        address, http_port = started.result()
        yield RunningGateway(address, f"http://127.0.0.1:{http_port}", stop, task, decodes)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        for decode in decodes:
            await decode.server.stop(0)


def request(prompt: str = "Hello", max_tokens: int = 4) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, sampling=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0))


async def generate(stub: generation_pb2_grpc.GenerationStub, message: generation_pb2.GenerateRequest,
                   timeout: float = 30) -> list[int]:
    tokens: list[int] = []
    async for response in stub.Generate(message, timeout=timeout):
        tokens += response.token_ids
    return tokens


async def code_of(call: Any) -> grpc.StatusCode | None:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return None


# -- item 5: a pooled client's streams over one connection ----------------------------------------------------
async def test_hundreds_of_streams_over_one_connection() -> None:
    async with running_gateway() as gateway, make_channel(gateway.grpc) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        num_streams = 600  # below --max-concurrent-requests (1024): every one must be served

        async def one(i: int) -> str:
            try:
                return "ok" if len(await generate(stub, request(f"stream {i}"))) == 4 else "short"
            except grpc.aio.AioRpcError as error:
                return f"{error.code().name}: {error.details()}"

        outcomes = await asyncio.gather(*(one(i) for i in range(num_streams)))
        failed = [o for o in outcomes if o != "ok"]
        assert not failed, f"{len(failed)} of {num_streams} failed, e.g. {failed[0]}"


async def test_a_grpc_client_that_cancels_mid_stream_cancels_its_request_on_decode() -> None:
    """`Generate` streams through `context.write`: the client's cancel reaches it there, the router's stream is
    closed at once, and decode gets the request's cancel (it frees its blocks); the next request is served."""
    async with running_gateway() as gateway, make_channel(gateway.grpc) as channel:
        decode = gateway.decodes[0].servicer
        decode.delay_s = 0.05  # 200 tokens: 10 s in flight
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request(max_tokens=200), timeout=30)
        assert (await call.read()).token_ids
        call.cancel()
        deadline = time.monotonic() + 5
        while not decode.cancelled and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert decode.cancelled == decode.started
        decode.delay_s = 0.0
        assert len(await generate(stub, request())) == 4


# -- item 7: drain covers HTTP ---------------------------------------------------------------------------------
async def test_drain_refuses_new_http_and_grpc_requests_while_those_in_flight_finish() -> None:
    async with running_gateway() as gateway, make_channel(gateway.grpc) as channel, \
            httpx2.AsyncClient(base_url=gateway.http, timeout=30) as http:
        gateway.decodes[0].servicer.delay_s = 0.05  # 40 tokens: 2 s in flight
        stub = generation_pb2_grpc.GenerationStub(channel)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 40, "stream": True}
        lines: list[str] = []

        async def http_stream() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line:
                        lines.append(line)

        in_flight = [asyncio.ensure_future(generate(stub, request(max_tokens=40))),
                     asyncio.ensure_future(http_stream())]
        while not lines:
            await asyncio.sleep(0.01)
        assert (await http.get("/health")).status_code == 200
        gateway.stop.set()  # what SIGTERM does
        await asyncio.sleep(0.1)

        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = await http.post("/v1/completions", json={"model": MODEL, "prompt": "new", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert await code_of(generate(stub, request("new"))) == grpc.StatusCode.UNAVAILABLE
        # Both requests in flight end with all their tokens; then the gateway exits.
        await asyncio.gather(*in_flight)
        assert len(in_flight[0].result() or []) == 40 and lines[-1] == "data: [DONE]"
        await asyncio.wait_for(gateway.task, 10)


# -- item 6: a frozen decode worker ---------------------------------------------------------------------------
async def test_a_frozen_decode_worker_s_requests_resume_elsewhere_token_exact() -> None:
    stall_s = 2.0
    async with running_gateway(num_decode=2, limits=GatewayLimits(decode_stall_timeout_s=stall_s)) as gateway, \
            make_channel(gateway.grpc) as channel:
        for decode in gateway.decodes:
            decode.servicer.delay_s = 0.02
        stub = generation_pb2_grpc.GenerationStub(channel)
        message = request("Tell me a story", max_tokens=60)
        expected = await generate(stub, message)
        tokens: list[int] = []
        num_started = [len(d.servicer.started) for d in gateway.decodes]
        frozen_at = 0.0
        started = time.monotonic()
        # A keepalive would notice the frozen worker after 30 s at best; the deadline is well before.
        async for response in stub.Generate(message, timeout=stall_s + 6):
            tokens += response.token_ids
            if len(tokens) >= 10 and not frozen_at:
                serving = next(d for d, n in zip(gateway.decodes, num_started, strict=True)
                               if len(d.servicer.started) > n)
                serving.servicer.freeze()
                frozen_at = time.monotonic()
        assert frozen_at, "never froze a worker"
        assert tokens == expected  # one uninterrupted stream: the same tokens
        assert time.monotonic() - frozen_at < stall_s + 3
        assert time.monotonic() - started < stall_s + 6


# -- item 8: malformed, oversized and mis-roled gRPC requests -------------------------------------------------
async def test_malformed_utf8_is_invalid_argument_naming_the_field() -> None:
    good = generation_pb2.GenerateRequest(prompt="hello", sampling=generation_pb2.SamplingParams(max_tokens=2))
    chat = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=2))
    chat.messages.messages.add(role="user", content="fine")
    chat.messages.messages.add(role="user", content="hello")
    stop = generation_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(stop=["a", "hello"]))
    cases = [
        (good.SerializeToString().replace(b"hello", b"he\xffo"), "prompt: is not valid UTF-8"),
        (chat.SerializeToString().replace(b"hello", b"\xc3\x28ell"),
         "messages.messages[1].content: is not valid UTF-8"),
        (stop.SerializeToString().replace(b"hello", b"\xed\xa0\x80ll"), "sampling.stop[1]: is not valid UTF-8"),
        (good.SerializeToString()[:-3], "request: is not a valid protobuf message"),
        (b"\xff\xff\xff", "request: is not a valid protobuf message"),
    ]
    async with running_gateway() as gateway, make_channel(gateway.grpc) as channel:
        generate_raw = channel.unary_stream("/tandem.v1.Generation/Generate",
                                            response_deserializer=generation_pb2.GenerateResponse.FromString)
        tokenize_raw = channel.unary_unary("/tandem.v1.Generation/Tokenize",
                                           response_deserializer=generation_pb2.TokenizeResponse.FromString)
        for data, details in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in generate_raw(data, timeout=10):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith(details), refused.value.details()
        bad_prompt = generation_pb2.TokenizeRequest(prompt="hello").SerializeToString().replace(b"hello", b"\x80")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokenize_raw(bad_prompt, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "prompt: is not valid UTF-8"
        # The same bytes, valid, are served.
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert len(await generate(stub, good)) == 2


async def test_grpc_accepts_exactly_the_chat_roles_http_accepts() -> None:
    async with running_gateway() as gateway, make_channel(gateway.grpc) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for role, accepted in [("user", True), ("system", True), ("assistant", True), ("developer", True),
                               ("tool", False), ("evil", False), ("", False), ("User", False)]:
            message = request(max_tokens=2)
            message.messages.messages.add(role="system", content="Be brief.")
            message.messages.messages.add(role=role, content="Hi")
            try:
                await generate(stub, message)
                assert accepted, role
            except grpc.aio.AioRpcError as error:
                assert not accepted, (role, error.details())
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (error.details() or "").startswith("messages: message 1: role"), error.details()


async def test_grpc_requests_past_the_limits_are_refused_before_any_work() -> None:
    async with running_gateway() as gateway, make_channel(gateway.grpc) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Past --max-request-bytes (16 MiB) the message is refused by gRPC itself.
        started = time.monotonic()
        assert await code_of(generate(stub, request("x" * (17 << 20)))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Within it, a prompt past 32 characters per token of context (2048) is refused before it is tokenized.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, request("word " * (2048 * 32 // 5 + 1)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith("prompt: is 65540 characters; at most 65536")
        assert time.monotonic() - started < 2.0  # neither was tokenized (17M characters take ~8 s)
        stop = request()
        stop.sampling.stop.extend(["s"] * 17)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, stop)
        assert (refused.value.details() or "").startswith("stop: 17 stop strings; at most 16")
        stop_ids = request()
        stop_ids.sampling.stop_token_ids.extend([49152])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, stop_ids)
        assert (refused.value.details() or "").startswith("stop_token_ids: token id 49152 is outside")
        assert len(await generate(stub, request())) == 4


# -- item 6, the worker's side: heartbeats while a request waits ----------------------------------------------
class SlowPrefill(worker_pb2_grpc.PrefillServicer):
    """A prefill worker that takes `delay_s` and then fails, so decode computes the prompt itself."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.num_calls = 0

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse]:
        self.num_calls += 1
        await asyncio.sleep(self.delay_s)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "too slow")
        yield worker_pb2.PrefillResponse()  # pragma: no cover


async def test_a_decode_worker_waiting_on_a_slow_prefill_is_not_taken_for_frozen() -> None:
    """Nothing is generated for longer than the stall timeout, but the worker's heartbeats keep the session."""
    slow = SlowPrefill(delay_s=3.5)

    def register(server: grpc.aio.Server) -> list[str]:
        add_prefill_to_server(slow, server)
        return ["tandem.v1.Prefill"]

    prefill_server, port, _ = await start_server("127.0.0.1:0", register)
    decode: Worker = await start_worker("decode")
    registry = StaticRegistry([f"127.0.0.1:{port}"], [decode.address])
    router = Router(load_gateway_model(MODEL, 256), registry, limits=GatewayLimits(decode_stall_timeout_s=2.0))
    try:
        tokens: list[int] = []
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        async with contextlib.aclosing(router.stream("slow", list(range(100, 140)), params, timeout=30)) as chunks:
            async for new_ids, _, _ in chunks:
                tokens += new_ids
        assert len(tokens) == 8 and slow.num_calls == 1  # served where it started, after the slow prefill
    finally:
        await router.close()
        await prefill_server.stop(0)
        await decode.server.stop(0)
        decode.engine.close()

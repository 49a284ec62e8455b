"""Fuzzing the public gRPC API (hypothesis) against a real gateway (`serve`, in a thread of its own): structured
`tandem.v1.GenerateRequest`s and `TokenizeRequest`s with hostile values, then raw bytes (valid requests with
bytes flipped, cut or inserted). Every call ends with its tokens and a finish, or with a clear status: never
UNKNOWN or INTERNAL, and INVALID_ARGUMENT always names its field. Fast fake decode workers take the bulk; a
smaller run goes through real prefill and decode workers, which must end with every KV block free. After each
run, the gateway still serves."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.gateway.limits import GatewayLimits
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.services.test_hardening import MODEL, running_gateway
from tests.services.test_reliability import start_worker

CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
NAMES_A_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]*: \S")
LIMITS = GatewayLimits(max_request_bytes=256 * 1024)

surrogate_free_text = st.text(st.characters(codec="utf-8"), max_size=16)
texts = surrogate_free_text | st.sampled_from(["", "Hi", "<|im_start|>", "\x00", "🌍" * 3, "x " * 2000])
int32s = st.integers(-(2**31), 2**31 - 1)
uint32s = st.sampled_from([0, 1, 2, 3, 8, 2047, 2048, 2**31, 2**32 - 1])
float32s = st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0])


@dataclass
class Gateway:
    address: str
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)  # type: ignore[arg-type]


def gateway_in_a_thread(make_workers: Callable[[], Awaitable[tuple[list[str], list[str], Any]]] | None = None,
                        ) -> Iterator[Gateway]:
    """A gateway serving from its own event loop thread, so that sync gRPC clients (hypothesis) can call it;
    `make_workers()` starts real workers in that loop (else fake decode workers are used)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    address: Future[str] = Future()
    stop = asyncio.Event()

    async def run() -> None:
        workers, cleanup = None, None
        if make_workers is not None:
            prefill, decode, cleanup = await make_workers()
            workers = (prefill, decode)
        try:
            async with running_gateway(limits=LIMITS, workers=workers) as gateway:
                address.set_result(gateway.grpc)
                await stop.wait()
        finally:
            if cleanup is not None:
                await cleanup()

    running = asyncio.run_coroutine_threadsafe(run(), loop)
    try:
        yield Gateway(address.result(60), loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        running.result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    yield from gateway_in_a_thread()


@st.composite
def generate_requests(draw: st.DrawFn, max_tokens: st.SearchStrategy[int] | None = None,
                      ) -> generation_pb2.GenerateRequest:
    # Half the requests are plausible throughout (so that many get as far as decode and back); in the others
    # each field is hostile one time in four.
    calm = draw(st.booleans())

    def pick(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> Any:
        return draw(hostile if not calm and draw(st.sampled_from([False, False, False, True])) else valid)

    message = generation_pb2.GenerateRequest(
        request_id=draw(texts), model=pick(st.sampled_from(["", MODEL]), st.sampled_from(["gpt-4"]) | texts))
    kind = pick(st.sampled_from(["prompt", "ids", "messages"]), st.just("none"))
    if kind == "prompt":
        message.prompt = pick(texts.filter(bool), texts | st.just("word " * 20_000))
    elif kind == "ids":
        message.prompt_token_ids.ids.extend(pick(st.lists(st.integers(0, 49151), min_size=1, max_size=12),
                                                 st.lists(int32s, max_size=12)))
    elif kind == "messages":
        roles = st.sampled_from(["user", "system", "assistant", "developer"])
        for role, content in draw(st.lists(st.tuples(roles, texts), min_size=1, max_size=4)):
            message.messages.messages.add(role=pick(st.just(role), st.sampled_from(["tool", "", "evil", "USER"])),
                                          content=content)
    sampling = message.sampling
    for name, valid, hostile in [
            ("max_tokens", max_tokens if max_tokens is not None else st.integers(1, 8) if calm
             else st.integers(1, 8) | uint32s, uint32s),
            ("temperature", st.floats(0, 2, width=32), float32s),
            ("top_p", st.floats(0.125, 1, width=32), float32s),
            ("top_k", st.integers(0, 50), int32s),
            ("seed", st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1])),
            ("ignore_eos", st.booleans(), st.booleans()),
            ("skip_special_tokens", st.booleans(), st.booleans())]:
        if name == "max_tokens" or draw(st.booleans()):
            setattr(sampling, name, pick(valid, hostile))
    sampling.stop.extend(pick(st.lists(texts.filter(bool), max_size=3),
                              st.lists(texts, max_size=3) | st.just(["s" * 300]) | st.just(["a"] * 20)))
    sampling.stop_token_ids.extend(pick(st.lists(st.integers(0, 49151), max_size=3), st.lists(int32s, max_size=3)))
    return message


def outcome(call: Callable[[], Any]) -> tuple[grpc.StatusCode | None, str]:
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), error.details() or ""  # type: ignore[attr-defined]
    return None, ""


def check_clear(code: grpc.StatusCode | None, details: str) -> None:
    if code is None:
        return
    assert code in CLEAR, f"{code}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert NAMES_A_FIELD.match(details), f"names no field: {details!r}"


def generate(address: str, message: generation_pb2.GenerateRequest | bytes) -> list[generation_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        if isinstance(message, bytes):
            method = channel.unary_stream("/tandem.v1.Generation/Generate",
                                          response_deserializer=generation_pb2.GenerateResponse.FromString)
            return list(method(message, timeout=20))
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(message, timeout=20))


def still_serves(address: str) -> None:
    message = generation_pb2.GenerateRequest(prompt="Hello", sampling=generation_pb2.SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True))
    responses = generate(address, message)
    assert sum(len(r.token_ids) for r in responses) == 3 and responses[-1].finish_reason


def _served_or_clear(address: str, message: generation_pb2.GenerateRequest | bytes) -> None:
    responses: list[generation_pb2.GenerateResponse] = []

    def call() -> None:
        responses.extend(generate(address, message))

    code, details = outcome(call)
    check_clear(code, details)
    if code is None:
        assert responses and responses[-1].finish_reason, "a stream that ended without a finish"


def fuzz(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@fuzz(150)
@given(message=generate_requests())
def test_every_generate_request_is_served_or_refused_naming_the_field(gateway: Gateway,
                                                                     message: generation_pb2.GenerateRequest) -> None:
    _served_or_clear(gateway.address, message)


@fuzz(40)
@given(model=texts, prompt=texts, roles=st.lists(st.sampled_from(["user", "tool", "x"]), max_size=3))
def test_every_tokenize_request_is_answered_or_refused_naming_the_field(gateway: Gateway, model: str, prompt: str,
                                                                       roles: list[str]) -> None:
    message = generation_pb2.TokenizeRequest(model=model, prompt=prompt)
    for role in roles:
        message.messages.messages.add(role=role, content=prompt)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        code, details = outcome(lambda: stub.Tokenize(message, timeout=20))
    check_clear(code, details)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A valid request's bytes with some flipped, cut or inserted (invalid UTF-8, bad lengths, bad tags)."""
    data = bytearray(draw(generate_requests(max_tokens=st.integers(1, 4))).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["flip", "cut", "insert"]))
        if edit == "insert" or position == len(data):
            data[position:position] = draw(st.binary(min_size=1, max_size=4) | st.sampled_from(
                [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]))
        elif edit == "flip":
            data[position] ^= draw(st.integers(1, 255))
        else:
            del data[position:position + draw(st.integers(1, 8))]
    return bytes(data)


@fuzz(120)
@given(data=mangled() | st.binary(max_size=64))
def test_every_byte_string_is_served_or_refused_naming_the_field(gateway: Gateway, data: bytes) -> None:
    _served_or_clear(gateway.address, data)


def test_the_gateway_still_serves_after_the_fuzzing(gateway: Gateway) -> None:
    still_serves(gateway.address)


# -- the same through real workers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_stack() -> Iterator[tuple[Gateway, list[Any]]]:
    workers: list[Any] = []

    async def make_workers() -> tuple[list[str], list[str], Any]:
        prefill, decode = await start_worker("prefill"), await start_worker("decode")
        workers.extend([prefill, decode])

        async def cleanup() -> None:
            for worker in workers:
                await worker.server.stop(0)
                worker.engine.close()

        return [prefill.address], [decode.address], cleanup

    for gateway in gateway_in_a_thread(make_workers):
        yield gateway, workers


@fuzz(25)
@given(message=generate_requests(max_tokens=st.integers(1, 6)))
def test_real_workers_serve_or_refuse_every_request(real_stack: tuple[Gateway, list[Any]],
                                                    message: generation_pb2.GenerateRequest) -> None:
    _served_or_clear(real_stack[0].address, message)


def test_real_workers_serve_and_free_every_block_after_the_fuzzing(real_stack: tuple[Gateway, list[Any]]) -> None:
    gateway, workers = real_stack
    still_serves(gateway.address)

    async def all_free() -> bool:
        for _ in range(200):
            if all(w.is_idle for w in workers):
                return True
            await asyncio.sleep(0.02)
        return False

    assert gateway.call(all_free()), "KV blocks still held"

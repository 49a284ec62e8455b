"""The gateway's limits on one request, over the OpenAI app in-process (ASGI, no sockets) and a real `Router`
whose decode worker is a fake session: bodies past the size limit refused before they are read whole, prompts
past the character limit before they are tokenized, messages, stop lists and sequences bounded, a request's
sequences counted against the concurrency limit all or none, large prompts tokenized off the event loop, and
drain refusing new HTTP requests. `FakeDecodeRouter` is shared with `test_fuzz_http.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import pytest

from tandem.common.config import ConfigError
from tandem.common.errors import InvalidRequestError
from tandem.gateway.http_api import create_app
from tandem.gateway.limits import GatewayLimits, MiB
from tandem.gateway.prompts import OFFLOAD_CHARS, encode_chat, encode_text
from tandem.gateway.router import GatewayModel, Router
from tandem.gateway.server import load_gateway_model
from tandem.gateway.sessions import RequestUpdates
from tandem.models import apply_chat_template
from tandem.serving.registry import WorkerRecord
from tandem.v1 import generation_pb2, worker_pb2

MODEL = "dummy:tiny"  # random weights never run here: only its (SmolLM2) tokenizer and config


def fake_token(prompt_ids: list[int], position: int, prompt_sum: int | None = None) -> int:
    """The fake decode worker's token at `position`: a function of the prompt and the position alone, so any
    worker continues a request token-exact."""
    return 1000 + ((sum(prompt_ids) if prompt_sum is None else prompt_sum) * 31 + position * 7) % 5000


class FakeSession:
    """Stands in for a `DecodeSession`: each started request streams `fake_token`s, `delay_s` apart, to its
    max_tokens. Records what it was asked to start."""

    def __init__(self) -> None:
        self.closed = False
        self.delay_s = 0.0
        self.tokens_per_update = 1
        self.started: list[worker_pb2.DecodeRequest] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, request: worker_pb2.DecodeRequest, timeout_s: float | None,
              trace_context: Any = None, stream_interval: int = 1, pacer: Any = None) -> RequestUpdates:
        self.started.append(request)
        updates = RequestUpdates(stream_interval, pacer=pacer)
        self._tasks[request.request_id] = asyncio.ensure_future(self._run(request, updates))
        return updates

    async def _run(self, request: worker_pb2.DecodeRequest, updates: RequestUpdates) -> None:
        prompt = list(request.prompt_token_ids)
        prompt_sum = sum(prompt)
        max_tokens = request.sampling.max_tokens
        for start in range(len(request.output_token_ids), max_tokens, self.tokens_per_update):
            await asyncio.sleep(self.delay_s)
            positions = range(start, min(start + self.tokens_per_update, max_tokens))
            response = worker_pb2.DecodeResponse(token_ids=[fake_token(prompt, p, prompt_sum) for p in positions],
                                                 logprobs=[-1.0] * len(positions))
            if positions[-1] == max_tokens - 1:
                response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            updates.put(worker_pb2.SessionUpdate(request_id=request.request_id, response=response))

    def finish(self, request_id: str, cancel: bool) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None and cancel:
            task.cancel()

    @property
    def num_running(self) -> int:
        return sum(not task.done() for task in self._tasks.values())

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()


class OneDecodeWorker:
    def workers(self, role: str) -> list[WorkerRecord]:
        if role != "decode":
            return []
        return [WorkerRecord(role="decode", address="fake:1", model=MODEL, fingerprint="", num_free_blocks=1,
                             num_total_blocks=1, queue_depth=0, worker_id="fake", updated_at=0.0)]


@functools.cache
def gateway_model(max_model_len: int) -> GatewayModel:
    return load_gateway_model(MODEL, max_model_len)


class FakeDecodeRouter(Router):
    """The gateway's real router (tokenization, limits, admission, detokenization) over a fake decode worker."""

    def __init__(self, limits: GatewayLimits | None = None, max_concurrent_requests: int = 1024,
                 max_model_len: int = 2048, model: GatewayModel | None = None) -> None:
        super().__init__(model or gateway_model(max_model_len), OneDecodeWorker(),  # type: ignore[arg-type]
                         max_concurrent_requests=max_concurrent_requests, limits=limits)
        self.session = FakeSession()

    def _session(self, address: str) -> Any:
        return self.session


@pytest.fixture
async def router() -> AsyncIterator[FakeDecodeRouter]:
    router = FakeDecodeRouter()
    yield router
    await router.close()


def http_client(router: Router) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(router)), base_url="http://test")


@pytest.fixture
async def http(router: FakeDecodeRouter) -> AsyncIterator[httpx2.AsyncClient]:
    async with http_client(router) as http:
        yield http


def chat(content: str = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def completion(prompt: Any = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}


def error_of(response: httpx2.Response) -> dict[str, Any]:
    return dict(response.json()["error"])


# -- the body ------------------------------------------------------------------------------------------------
async def raw_post(app: Any, chunks: Iterator[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """POST a body arriving in `chunks` straight through ASGI: (status, number of chunks the server read)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), *headers], "client": ("t", 1), "server": ("t", 80)}
    num_read = 0
    status = 0
    body_done = False

    async def receive() -> dict[str, Any]:
        nonlocal num_read, body_done
        if body_done:  # the client stays connected until it has its answer
            await asyncio.Event().wait()
        chunk = next(chunks, None)
        if chunk is None:
            body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        num_read += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return status, num_read


async def test_a_body_past_the_limit_is_413_before_it_is_read_whole(router: FakeDecodeRouter) -> None:
    app = create_app(router)
    limit = router.limits.max_request_bytes
    assert limit == 16 * MiB
    # A declared length past the limit: refused before a byte is read.
    status, num_read = await raw_post(app, iter([b"x" * MiB] * 17), [(b"content-length", str(17 * MiB).encode())])
    assert (status, num_read) == (413, 0)
    # No length (chunked): refused as soon as the bytes pass the limit, not after the client's 64 MiB.
    status, num_read = await raw_post(app, iter([b" " * MiB] * 64), [])
    assert status == 413 and num_read == 17
    # A body within it goes through.
    body = json.dumps(completion(prompt="x" * 1000)).encode()
    assert (await raw_post(app, iter([body[:100], body[100:]]), []))[0] == 200


async def test_the_body_limit_is_configurable(http: httpx2.AsyncClient) -> None:
    small = FakeDecodeRouter(GatewayLimits(max_request_bytes=1000))
    async with http_client(small) as client:
        response = await client.post("/v1/completions", json=completion(prompt="x" * 2000))
        assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
        assert (await client.post("/v1/completions", json=completion(prompt="x" * 100))).status_code == 200
    await small.close()


# -- prompts, messages, stop, sequences ----------------------------------------------------------------------
class CountingTokenizer:
    """Wraps a tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.num_chars = 0
        self.chat_template = tokenizer.chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.num_chars += len(text)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        self.num_chars += sum(len(m["content"]) for m in messages)
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


async def test_a_prompt_past_32_chars_per_token_of_context_is_refused_before_tokenizing() -> None:
    counting = CountingTokenizer(gateway_model(512).tokenizer)
    router = FakeDecodeRouter(model=dataclasses.replace(gateway_model(512), tokenizer=counting))
    async with http_client(router) as http:
        too_long = "word " * (512 * 32 // 5 + 1)
        for body in (completion(prompt=too_long), chat(content=too_long),
                     completion(prompt=["ok", too_long])):
            response = await http.post("/v1/" + ("chat/completions" if "messages" in body else "completions"),
                                       json=body)
            assert response.status_code == 400, response.text
            assert error_of(response)["param"] in ("prompt", "messages")
            assert f"at most {512 * 32}" in error_of(response)["message"]
        assert counting.num_chars <= 2  # only the short prompt ("ok") was encoded
        # Within the limit it is tokenized (and refused only if its tokens do not fit the context).
        response = await http.post("/v1/completions", json=completion(prompt="word " * 100))
        assert response.status_code == 200
    await router.close()


@pytest.mark.parametrize(("body", "param", "words"), [
    ({**chat(), "messages": [{"role": "user", "content": "hi"}] * 2049}, "messages", "at most 2048"),
    (chat(stop=[f"s{i}" for i in range(17)]), "stop", "at most 16"),
    (chat(stop="x" * 257), "stop", "at most 256"),
    (chat(stop_token_ids=list(range(1025))), "stop_token_ids", "at most 1024"),
    (chat(n=129), "n", "at most 128"),
    (completion(prompt=["a"] * 129), "prompt", "at most 128"),
    (completion(prompt=["a"] * 32, n=5), "n", "160 sequences"),
])
async def test_counts_past_their_limit_are_400_naming_the_field(http: httpx2.AsyncClient, router: FakeDecodeRouter,
                                                                 body: dict[str, Any], param: str, words: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param and words in error_of(response)["message"]
    assert not router.session.started  # nothing reached decode


async def test_128_sequences_are_accepted(http: httpx2.AsyncClient, router: FakeDecodeRouter) -> None:
    response = await http.post("/v1/completions", json=completion(prompt=["a", "b"], n=64, max_tokens=2))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 128 and len(router.session.started) == 128


def test_limits_are_validated() -> None:
    for bad in ({"max_request_bytes": 0}, {"max_prompt_chars": 0}, {"max_messages": 0},
                {"max_sequences_per_request": 0}, {"decode_stall_timeout_s": 0.1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            GatewayLimits(**bad)  # type: ignore[arg-type]
    assert GatewayLimits().prompt_chars(8192) == 32 * 8192
    assert GatewayLimits(max_prompt_chars=10).prompt_chars(8192) == 10


# -- concurrency slots ---------------------------------------------------------------------------------------
async def test_a_request_takes_a_slot_per_sequence_all_or_none() -> None:
    router = FakeDecodeRouter(max_concurrent_requests=4)
    router.session.delay_s = 0.05
    async with http_client(router) as http:
        # Three sequences stream (n=3): three of the four slots are taken.
        first = asyncio.ensure_future(http.post("/v1/completions", json=completion(n=3, max_tokens=20)))
        for _ in range(200):
            if router.session.num_running == 3:
                break
            await asyncio.sleep(0.01)
        assert router.admission.num_active == 3
        # Two more do not fit the one slot left: refused whole, at once, nothing started for them.
        response = await http.post("/v1/completions", json=completion(n=2))
        assert response.status_code == 429 and "2 sequences asked for, 1 free" in error_of(response)["message"]
        assert len(router.session.started) == 3
        # One still does.
        assert (await http.post("/v1/completions", json=completion(max_tokens=2))).status_code == 200
        assert (await first).status_code == 200
        assert router.admission.num_active == 0
        # A request larger than the whole limit can never fit.
        response = await http.post("/v1/completions", json=completion(prompt=["a", "b", "c"], n=2))
        assert response.status_code == 429
    await router.close()


# -- large prompts off the event loop -------------------------------------------------------------------------
class LoopStalls:
    """The longest the event loop went without running a 5 ms ticker, while in the `async with` block. The gateway
    serves everyone from one loop: while it is held, every stream and `/health` waits. The collector is kept to
    the objects made in the block: the test process holds torch and every model other tests loaded (a full pass
    over them takes ~0.2 s), the gateway does not, and the measure is of the gateway's own work."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.took = 0.0
        self._ticker: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopStalls:
        gc.collect()
        gc.freeze()
        self._ticker = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0.02)
        self.took = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.took = time.perf_counter() - self.took
        await asyncio.sleep(0.02)  # the ticker's turn: a stall shows as the gap it measures next
        assert self._ticker is not None
        self._ticker.cancel()
        gc.unfreeze()

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def check(self) -> None:
        # A fixed bound would also catch a machine busy with other work; a stall of a quarter of the whole
        # request's time (a second or so before) would not come from that.
        bound = max(0.15, self.took / 4)
        assert self.longest < bound, f"the event loop stalled {self.longest:.2f} s of {self.took:.2f} s"


async def test_a_huge_prompt_delays_no_one_else() -> None:
    # A context of 65536 tokens accepts 2M characters: encoding them takes the tokenizer about a second.
    router = FakeDecodeRouter(max_model_len=65536)
    body = json.dumps(completion(prompt="hello world " * 170_000))
    async with http_client(router) as http:
        async with LoopStalls() as stalls:
            response = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400 and error_of(response)["param"] == "prompt"  # too many tokens
        assert stalls.took > 0.3, "the prompt was not encoded at all"
        # Parsing the 2 MB body still happens on the loop (a few ms); encoding it does not.
        stalls.check()
    await router.close()


async def test_a_huge_reply_s_logprobs_delay_no_one_else() -> None:
    router = FakeDecodeRouter(max_model_len=65536)
    router.session.tokens_per_update = 2000
    # 4 choices of 32000 tokens, each token's text and logprob in the one body at the end.
    body = chat(n=4, max_tokens=32000, logprobs=True, ignore_eos=True)
    async with http_client(router) as http:
        async with LoopStalls() as stalls:
            response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        assert sum(len(c["logprobs"]["content"]) for c in response.json()["choices"]) == 4 * 32000
        stalls.check()
    await router.close()


def test_encoding_off_the_loop_gives_the_same_ids() -> None:
    tokenizer = gateway_model(2048).tokenizer
    for text in ["Hello there!", "héllo wörld 🌍 " * 50, "<|im_start|>user\nHi<|im_end|>", "x" * (OFFLOAD_CHARS + 1)]:
        assert encode_text(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi " * 3000}]
    assert encode_chat(tokenizer, messages) == apply_chat_template(tokenizer, messages)


# -- chat roles, the same on both doors ----------------------------------------------------------------------
async def test_chat_roles_are_those_http_accepts(router: FakeDecodeRouter) -> None:
    for role in ("tool", "evil", "", "System"):
        with pytest.raises(InvalidRequestError, match="messages: message 1: role"):
            await router.prompt_ids(messages=[{"role": "user", "content": "a"}, {"role": role, "content": "b"}])
    developer = await router.prompt_ids(messages=[{"role": "developer", "content": "Be brief."}])
    system = await router.prompt_ids(messages=[{"role": "system", "content": "Be brief."}])
    assert developer == system


# -- drain ---------------------------------------------------------------------------------------------------
async def test_draining_refuses_new_http_requests_and_health(http: httpx2.AsyncClient,
                                                            router: FakeDecodeRouter) -> None:
    assert (await http.get("/health")).status_code == 200
    router.begin_drain()
    response = await http.post("/v1/completions", json=completion())
    assert response.status_code == 503 and error_of(response)["code"] == "service_unavailable"
    assert response.headers["connection"] == "close"
    assert (await http.get("/health")).status_code == 503
    assert (await http.get("/metrics")).status_code == 200  # still scraped while draining
    assert not router.session.started

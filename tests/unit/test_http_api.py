"""The OpenAI-compatible app over a fake router, in-process (ASGI, no sockets): request checking,
response shapes (parsed by the official `openai` client), streaming, errors, and client disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx2
import openai
import pytest

from tandem.common.errors import InvalidRequestError, UnavailableError
from tandem.common.sampling_params import SamplingParams
from tandem.gateway.http_api import create_app
from tandem.gateway.router import Completion, GatewayModel, Router
from tandem.serving.registry import WorkerRecord

MODEL = "fake-model"
# The fake model's output: one character per token, cycling through this text.
OUTPUT = "abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One token per character (ids are code points), with a trivial chat template."""

    chat_template = "role: content"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


class FakeRegistry:
    def __init__(self) -> None:
        self.num_decode = 1

    def workers(self, role: str) -> list[WorkerRecord]:
        record = WorkerRecord(role="decode", address="fake:1", model=MODEL, fingerprint="", num_free_blocks=1,
                              num_total_blocks=1, queue_depth=0, worker_id="fake", updated_at=0.0)
        return [record] * (self.num_decode if role == "decode" else 0)


class FakeRouter(Router):
    """A router whose decode is a loop: one character per message, `delay_s` apart; `unavailable`
    makes every request fail as if no worker were up."""

    def __init__(self) -> None:
        model = GatewayModel(MODEL, SimpleNamespace(vocab_size=0x110000), max_model_len=64,
                             tokenizer=CharTokenizer())
        super().__init__(model, FakeRegistry())
        self.delay_s = 0.0
        self.unavailable = False
        self.params: list[SamplingParams] = []
        self.num_open = 0

    async def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     timeout: float | None = None, trace_context: Any = None,
                     ) -> AsyncGenerator[tuple[list[int], str, Completion], None]:
        if len(prompt_ids) + params.max_tokens > self.model.max_model_len:
            raise InvalidRequestError("max_tokens", "exceeds the context length")
        if self.unavailable:
            raise UnavailableError("no decode worker")
        self.params.append(params)
        self.num_open += 1
        progress = Completion(request_id, prompt_ids, [])
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.delay_s)
                token = ord(OUTPUT[i % len(OUTPUT)])
                text = chr(token)
                progress.token_ids.append(token)
                progress.logprobs.append(-0.5)
                if text in params.stop:  # single-character stop strings only
                    text = ""
                    progress.finish_reason = "stop"
                elif i == params.max_tokens - 1:
                    progress.finish_reason = "length"
                progress.text_parts.append(text)
                yield [token], text, progress
                if progress.finish_reason is not None:
                    return
        finally:
            self.num_open -= 1


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
async def http(router: FakeRouter) -> AsyncIterator[httpx2.AsyncClient]:
    # The app in-process: openai's own HTTP library (httpx2) calls it through ASGI, no sockets.
    transport = httpx2.ASGITransport(app=create_app(router))
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


@pytest.fixture
def client(http: httpx2.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


async def test_chat_completion(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, seed=7, n=1, presence_penalty=0,
                                                 user="someone")
    assert reply.object == "chat.completion" and reply.model == MODEL
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "abcde", "length")
    prompt = "user: Hi\nassistant: "
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(prompt), 5, len(prompt) + 5)
    assert router.params[0] == SamplingParams(max_tokens=5, temperature=0.0, seed=7)


async def test_chat_defaults_to_the_rest_of_the_context(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 64 - len("user: Hi\nassistant: ")
    assert router.params[0].temperature == SamplingParams().temperature


async def test_chat_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_completion_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "abcd"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


async def test_stop_and_logprobs(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=10, stop="d", logprobs=True, top_logprobs=0)
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("abc", "stop")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [(t.token, t.logprob) for t in choice.logprobs.content] == [(c, -0.5) for c in "abcd"]


async def test_completions_batch_and_n(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    reply = await client.completions.create(model=MODEL, prompt=["one", "three"], max_tokens=3, n=2, seed=5)
    assert reply.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [(i, "abc", "length") for i in range(4)]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len("one") + len("three"), 12)
    # n samples of one prompt get distinct, reproducible seeds.
    assert sorted(p.seed for p in router.params) == [5, 5, 6, 6]


async def test_completion_stream_of_token_ids(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=3, stream=True,
                                             logprobs=0)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == "abc"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].logprobs is not None
    assert chunks[0].choices[0].logprobs.token_logprobs == [-0.5]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 100}, "max_completion_tokens"),  # prompt + 100 > the context of 64
    ({"n": 0}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"best_of": 2}}, "best_of"),  # a completions-only parameter
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages.0.role"),
])
async def test_bad_chat_values_are_400_naming_the_field(client: openai.AsyncOpenAI, kwargs: dict[str, Any],
                                                        param: str) -> None:
    request: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(**request)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "extra_body": {"frobnicate": 1}}, "frobnicate"),
])
async def test_bad_completion_values_are_400_naming_the_field(client: openai.AsyncOpenAI, kwargs: dict[str, Any],
                                                              param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, **kwargs)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


async def test_unknown_model_is_404_and_unavailable_is_503(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-4", prompt="x")
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_found"
    router.unavailable = True
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.completions.create(model=MODEL, prompt="x", stream=stream)
        assert unavailable.value.status_code == 503


async def test_models_health_metrics(client: openai.AsyncOpenAI, http: httpx2.AsyncClient,
                                     router: FakeRouter) -> None:
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    assert (await http.get("http://test/health")).status_code == 200
    metrics = await http.get("http://test/metrics")
    assert metrics.headers["content-type"].startswith("text/plain") and "tandem_requests" in metrics.text
    router.registry.num_decode = 0
    assert (await http.get("http://test/health")).status_code == 503


async def asgi_call(app: Any, path: str, body: dict[str, Any], disconnect: asyncio.Event,
                    sent: list[dict[str, Any]]) -> None:
    """One POST straight through ASGI; `disconnect` set = the client hangs up."""
    request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": b"", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("t", 80)}
    messages = [request]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_request(router: FakeRouter, stream: bool) -> None:
    router.delay_s = 0.02
    disconnect = asyncio.Event()
    sent: list[dict[str, Any]] = []
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "n": 2,
            "stream": stream}
    call = asyncio.create_task(asgi_call(create_app(router), "/v1/completions", body, disconnect, sent))
    for _ in range(200):
        if router.num_open == 2:
            break
        await asyncio.sleep(0.01)
    assert router.num_open == 2, sent
    await asyncio.sleep(0.1)  # a few tokens in
    disconnect.set()
    await asyncio.wait_for(call, timeout=2)
    # Both choices' streams are closed (decode would free their blocks) long before their 0.8 s were up.
    assert router.num_open == 0
    if stream:
        chunks = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
        assert 0 < len(chunks) < 40

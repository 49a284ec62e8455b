"""The OpenAI-compatible HTTP API of a running stack (`tandem up`, SmolLM2-135M), driven by the official
`openai` client: chat and completions, streamed and not, against the gRPC API's output."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tandem.v1 import generation_pb2
from tests.e2e.test_stack import RunningStack, chat_request, start_stack, stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
PROMPT = "The three primary colors are"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[RunningStack]:
    yield from start_stack(tmp_path_factory.mktemp("openai"))


@pytest.fixture(scope="module")
def base_url(stack: RunningStack) -> str:
    return str(next(s for s in stack.services if s["role"] == "gateway")["http"])


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def grpc_completion(stack: RunningStack, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    request = generation_pb2.GenerateRequest(prompt=prompt, sampling=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0))
    token_ids, text, _, _ = stream(stack.address("gateway"), request)
    return token_ids, text


def test_chat_equals_grpc_streamed_or_not(stack: RunningStack, client: openai.OpenAI) -> None:
    grpc_ids, grpc_text, _, last = stream(stack.address("gateway"), chat_request(QUESTION))
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == grpc_text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(grpc_ids)
    assert reply.usage.prompt_tokens == last.usage.prompt_tokens  # type: ignore[attr-defined]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(grpc_ids)


def test_completion_equals_grpc_streamed_or_not(stack: RunningStack, client: openai.OpenAI) -> None:
    grpc_ids, grpc_text = grpc_completion(stack, PROMPT, 12)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason) == (grpc_text, "length")
    assert reply.usage is not None and reply.usage.completion_tokens == len(grpc_ids) == 12
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == grpc_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence_cuts_the_text(stack: RunningStack, client: openai.OpenAI) -> None:
    _, full = grpc_completion(stack, PROMPT, 16)
    # A word from the middle of the greedy continuation.
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[len(words) // 2]
    expected = full[:full.index(stop)]
    for streamed in (False, True):
        if streamed:
            chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                    stop=[stop, "\u2603"], stream=True))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
            text, finish = reply.choices[0].text, reply.choices[0].finish_reason
            assert reply.usage is not None and reply.usage.completion_tokens < 16
        assert (text, finish) == (expected, "stop")


def test_bad_value_is_400_with_openai_body(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=-1)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "temperature"
    assert caught.value.body["type"] == "invalid_request_error"
    assert "temperature" in caught.value.body["message"]


def test_models_and_health(base_url: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx2.get(f"{base_url}/health").status_code == 200
    assert "tandem_time_to_first_token_seconds" in httpx2.get(f"{base_url}/metrics").text


def test_disconnect_mid_stream_frees_blocks(stack: RunningStack, base_url: str) -> None:
    total = stack.metric("decode", "tandem_kv_blocks_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx2.Client(timeout=60) as http, http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        num_events = 0
        for line in response.iter_lines():
            num_events += line.startswith("data: ")
            if num_events == 3:
                break
        # Mid-stream: the request holds blocks on decode. Sampled for up to 5 s, not once: on a loaded 2-core machine
        # one sample was seen at the full count (not pinned down; the suspect is a stall failover that re-admits it).
        deadline = time.monotonic() + 5
        while stack.metric("decode", "tandem_kv_blocks_free") >= total:
            assert time.monotonic() < deadline, "decode holds no blocks for a request that is streaming"
            time.sleep(0.05)
    # The connection is closed: the gateway cancels the request, and decode frees its blocks long before
    # the 900 tokens could have been generated.
    deadline = time.monotonic() + 10
    while stack.metric("decode", "tandem_kv_blocks_free") < total:
        assert time.monotonic() < deadline, "decode still holds the disconnected request's blocks"
        time.sleep(0.1)

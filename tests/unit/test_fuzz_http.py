"""Fuzzing the OpenAI API (hypothesis): bodies of every shape the JSON allows (types, ranges, unicode including
lone surrogates, sizes, unknown fields) through the app in-process, over the real router with a fast fake decode
worker. Every answer is a normal reply or a clear 4xx in OpenAI's error shape (a 400 names its field when it has
one), never a 500 or a hang, and the app still serves afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.gateway.limits import GatewayLimits
from tests.unit.test_limits import MODEL, FakeDecodeRouter, http_client

# Small limits, so that bodies past them are cheap to make; the defaults are tested in test_limits.py.
LIMITS = GatewayLimits(max_request_bytes=64 * 1024, max_sequences_per_request=16, max_stop_sequences=4,
                       max_stop_chars=16, max_messages=8, max_stop_token_ids=8)
EXAMPLES = 600

surrogates = st.integers(0xD800, 0xDFFF).map(chr)  # st.characters() never draws one
any_char = st.characters(codec="utf-8") | surrogates  # st.text() alone never draws a lone surrogate
texts = st.text(max_size=12) | st.text(any_char, max_size=12) | st.sampled_from(["", "Hi", "<|im_end|>", "🌍"])
ints = st.integers(-3, 40) | st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63, 2**64 - 1, 2**64, -(2**63), 10**30])
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e300, -0.0])
scalars = st.none() | st.booleans() | ints | floats | texts
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=2),
                      max_leaves=6)

clean_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                 "content": clean_text | st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": clean_text}), min_size=1, max_size=2)})
# Values a client would send: a request made of these only is served.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, ""]), "messages": st.lists(message, min_size=1, max_size=4),
    "prompt": clean_text | st.lists(st.integers(0, 49151), min_size=1, max_size=6)
    | st.lists(clean_text, min_size=1, max_size=3),
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "n": st.integers(1, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**64 - 1), "stop": clean_text | st.lists(clean_text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0), "logit_bias": st.just({}), "user": clean_text, "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "echo": st.just(False), "best_of": st.just(1), "suffix": st.just(""),
    "response_format": st.just({"type": "text"}), "top_logprobs": st.just(0),
}
CHAT_FIELDS = ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"]
COMPLETION_FIELDS = ["prompt", "logprobs", "echo", "best_of", "suffix"]
SHARED_FIELDS = ["model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                 "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "ignore_eos",
                 "stop_token_ids", "skip_special_tokens"]


def valid(name: str, is_chat: bool) -> st.SearchStrategy[Any]:
    if name == "logprobs":
        return st.booleans() if is_chat else st.just(0)
    return VALID[name]


def hostile(name: str) -> st.SearchStrategy[Any]:
    """Values of roughly the field's own type, out of its range or badly encoded; or anything at all."""
    messages = st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "tool", "evil", ""]),
        "content": texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                           "text": texts}), max_size=2)}), max_size=10)
    return {
        "model": texts, "messages": messages,
        "prompt": texts | st.lists(ints, max_size=6) | st.lists(texts, max_size=20)
        | st.lists(st.lists(ints, max_size=4), max_size=3) | st.just("x" * 70_000),
        "temperature": floats | ints, "top_p": floats | ints, "presence_penalty": floats, "frequency_penalty": floats,
        "stop": texts | st.lists(texts, max_size=6) | st.just("s" * 20),
        "stop_token_ids": st.lists(ints, max_size=10), "logit_bias": st.dictionaries(texts, floats, max_size=2),
        "user": texts, "suffix": texts,
    }.get(name, ints | values)


def one_in(draw: st.DrawFn, n: int) -> bool:
    # sampled_from, not integers: hypothesis draws the bounds of an integer range far more often than 1 in n.
    return bool(draw(st.sampled_from([False] * (n - 1) + [True])))


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """A third of the bodies are valid throughout, a third have one hostile field (so that it reaches as far as
    the checks go), a third are hostile anywhere."""
    is_chat = draw(st.booleans())
    fields = (CHAT_FIELDS if is_chat else COMPLETION_FIELDS) + SHARED_FIELDS
    mode = draw(st.sampled_from(["valid", "one hostile", "wild"]))
    # The input is always drawn, and is the hostile field as often as any other is.
    input_name = "messages" if is_chat else "prompt"
    hostile_input = mode != "valid" and one_in(draw, 3)
    body: Any = {"model": MODEL, "max_tokens": 3, input_name: draw(
        hostile(input_name) if hostile_input else valid(input_name, is_chat))}
    if hostile_input and mode == "one hostile":
        mode = "valid"
    names = draw(st.lists(st.sampled_from([f for f in fields if f != input_name]), max_size=5, unique=True))
    for i, name in enumerate(names):
        wild = mode == "wild" and one_in(draw, 2) or mode == "one hostile" and i == len(names) - 1
        body[name] = draw(hostile(name) if wild else valid(name, is_chat))
    if mode == "wild" and one_in(draw, 5):
        body[draw(texts)] = draw(values)  # an unknown field
    if mode == "wild" and one_in(draw, 10):
        body = draw(values)  # not an object at all
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), body


def check_answer(response: httpx2.Response, body: Any) -> None:
    status = response.status_code
    assert status in (200, 400, 404, 413, 429), (status, response.text[:500])
    if status != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"] in ("invalid_request_error", "rate_limit_error"), error
        assert error["param"] is None or isinstance(error["param"], str)
        return
    if isinstance(body, dict) and body.get("stream") is True:
        events = [line for line in response.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event[len("data: "):]), event
    else:
        reply = response.json()
        assert reply["choices"] and all(c["finish_reason"] in ("stop", "length") for c in reply["choices"])


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_every_body_gets_a_reply_or_a_clear_4xx(case: tuple[str, Any]) -> None:
    path, body = case
    # ensure_ascii: a lone surrogate travels as its JSON escape (\\udXXX), as a hostile client would send it.
    raw = json.dumps(body, ensure_ascii=True).encode()

    async def run() -> None:
        router = FakeDecodeRouter(LIMITS, max_concurrent_requests=32, max_model_len=512)
        async with http_client(router) as http:
            response = await asyncio.wait_for(
                http.post(path, content=raw, headers={"content-type": "application/json"}), timeout=10)
            check_answer(response, body)
            # And it still serves.
            after = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
            assert router.admission.num_active == 0  # every slot given back
        await router.close()

    asyncio.run(run())

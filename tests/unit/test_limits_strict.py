"""Strict values on the OpenAI API (the app in-process over the real router and a fake decode worker): an
out-of-range number, a boolean where an integer belongs, a lone surrogate or invalid JSON is a 400 naming the
field, never a 500 and never a value silently wrapped or coerced."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from tests.unit.test_limits import MODEL, FakeDecodeRouter, chat, completion, error_of, http_client


@pytest.fixture
async def router() -> AsyncIterator[FakeDecodeRouter]:
    router = FakeDecodeRouter()
    yield router
    await router.close()


@pytest.fixture
async def http(router: FakeDecodeRouter) -> AsyncIterator[httpx2.AsyncClient]:
    async with http_client(router) as http:
        yield http


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"n": True}, "n"),
    ({"stream": 1}, "stream"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": 1e300}, "temperature"),  # finite, but no float32 (the worker's field) holds it
    ({"seed": 2**64}, "seed"),  # was wrapped modulo 2**64 to seed 0
    ({"seed": 2**64 + 7}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"),
    ({"top_k": 2**40}, "top_k"),  # was a 500 (the worker's int32)
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),  # was a 500
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
async def test_out_of_range_and_loose_values_are_400_naming_the_field(
        http: httpx2.AsyncClient, router: FakeDecodeRouter, fields: dict[str, Any], param: str) -> None:
    for path, body in (("/v1/completions", completion(**fields)), ("/v1/chat/completions", chat(**fields))):
        response = await http.post(path, json=body)
        assert response.status_code == 400, (path, response.status_code, response.text)
        assert error_of(response)["param"].split(".")[0] == param, response.text
    assert not router.session.started


async def test_the_largest_seed_is_taken_as_is(http: httpx2.AsyncClient, router: FakeDecodeRouter) -> None:
    response = await http.post("/v1/completions", json=completion(seed=2**64 - 1))
    assert response.status_code == 200
    assert router.session.started[0].sampling.seed == 2**64 - 1


def _raw(text: str) -> bytes:
    """A JSON body as raw text: the JSON escapes stay as written (`\\ud800` is a lone surrogate)."""
    return text.encode()


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"model": "dummy:tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "dummy:tiny", "prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", '{"model": "dummy:tiny", "prompt": "x", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/completions", '{"model": "dummy:tiny", "prompt": "x", "user": "\\ud800"}', "user"),
    ("/v1/chat/completions", '{"model": "dummy:tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    ("/v1/chat/completions",
     '{"model": "dummy:tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
    ("/v1/completions", '{"model": "dummy:tiny", "prompt": "x", "\\ud800": 1}', None),  # a key: no field to name
])
async def test_lone_surrogates_are_400_naming_the_field(http: httpx2.AsyncClient, path: str, body: str,
                                                        param: str | None) -> None:
    response = await http.post(path, content=_raw(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    named = error_of(response)["param"]
    assert (named and named.split(".")[0]) == param, response.text


async def test_a_surrogate_pair_is_a_character(http: httpx2.AsyncClient) -> None:
    body = '{"model": "dummy:tiny", "prompt": "a \\ud83d\\ude00 b", "max_tokens": 2}'  # an escaped emoji
    response = await http.post("/v1/completions", content=_raw(body), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body", [b"{", b'{"model": "dummy:tiny", "prompt": "x",}', b"\xff\xfe", b"[1, 2]", b"null",
                                  b'{"prompt": 1' + b"1" * 5000 + b"}"])
async def test_bodies_that_are_not_json_objects_are_400(http: httpx2.AsyncClient, body: bytes) -> None:
    response = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] == "invalid_request_error"


async def test_it_still_serves_after_them(http: httpx2.AsyncClient) -> None:
    for body in (b'{"model": "\\ud800", "prompt": "x"}', b'{"prompt": "x", "top_k": 1099511627776}'):
        await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3

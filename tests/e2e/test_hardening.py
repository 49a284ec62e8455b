"""The hardened gateway with the stack as processes (`tandem up --model dummy:tiny`, two decode workers):
a decode worker frozen mid-stream (SIGSTOP) has its streams resumed on the other one, token-exact, within the
gateway's `--decode-stall-timeout` rather than a keepalive's half minute; and SIGTERM to the gateway drains its
HTTP door too (new requests and `/health` 503) while a stream in flight finishes."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tandem.v1 import generation_pb2_grpc
from tests.e2e.test_chaos import PROMPTS, busiest_decode, live_workers, request_for, scrape
from tests.e2e.test_stack import RunningStack, _alive, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "dummy:tiny"
STALL_S = 2.0
# gRPC keepalive (tandem.serving.rpc) finds a frozen peer after 10 s at the very least (20 s + 10 s typically).
KEEPALIVE_MIN_S = 10.0


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    with tempfile.TemporaryDirectory() as tmp:
        yield from start_stack(Path(tmp), "--decode-stall-timeout", str(STALL_S), model=MODEL, num_decode=2)


def stream(address: str, index: int, on_tokens: object = None) -> tuple[list[int], float, grpc.StatusCode | None]:
    """(tokens, monotonic time the stream ended, status code if it failed) of one request."""
    tokens: list[int] = []
    code = None
    with grpc.insecure_channel(address) as channel:
        try:
            for response in generation_pb2_grpc.GenerationStub(channel).Generate(request_for(index), timeout=60):
                tokens += response.token_ids
                if callable(on_tokens):
                    on_tokens(index, len(tokens))
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
    return tokens, time.monotonic(), code


def wait_all_blocks_free(stack: RunningStack) -> dict[str, tuple[float, float]]:
    deadline = time.monotonic() + 15
    while True:
        pools = {str(s["grpc"]): (scrape(str(s["http"]), "tandem_kv_blocks_free"),
                                  scrape(str(s["http"]), "tandem_kv_blocks_total")) for s in live_workers(stack)}
        if all(free == total for free, total in pools.values()) or time.monotonic() > deadline:
            return pools
        time.sleep(0.2)


def test_a_frozen_decode_worker_s_streams_resume_elsewhere_token_exact(stack: RunningStack) -> None:
    gateway = stack.address("gateway")
    indices = list(range(len(PROMPTS)))
    with ThreadPoolExecutor(len(indices)) as pool:
        expected = {i: tokens for i, (tokens, _, _) in zip(indices, pool.map(lambda i: stream(gateway, i), indices),
                                                             strict=True)}
    assert all(len(tokens) == 120 for tokens in expected.values())

    frozen: list[tuple[int, float]] = []
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def on_tokens(index: int, count: int) -> None:
        with lock:
            counts[index] = count
            if not frozen and len(counts) == len(indices) and min(counts.values()) >= 10:
                pid = busiest_decode(stack)
                os.kill(pid, signal.SIGSTOP)  # frozen: its connections stay up, it answers nothing
                frozen.append((pid, time.monotonic()))

    try:
        with ThreadPoolExecutor(len(indices)) as pool:
            outcomes = list(pool.map(lambda i: stream(gateway, i, on_tokens), indices))
        assert frozen, "no worker was frozen"
        pid, frozen_at = frozen[0]
        for index, (tokens, ended_at, code) in zip(indices, outcomes, strict=True):
            assert code is None, f"stream {index} failed: {code}"
            assert tokens == expected[index], f"stream {index} is not token-exact"
            assert ended_at - frozen_at < KEEPALIVE_MIN_S, f"stream {index} waited {ended_at - frozen_at:.1f} s"
        gateway_log = Path(str(next(s for s in stack.services if s["role"] == "gateway")["log"])).read_text()
        assert "taken for frozen" in gateway_log
    finally:
        for pid, _ in frozen:
            os.kill(pid, signal.SIGCONT)
    # Woken up, the worker finds its session cancelled and frees every block its requests held.
    pools = wait_all_blocks_free(stack)
    assert all(free == total for free, total in pools.values()), pools


def _http(url: str, body: dict[str, object] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_sigterm_drains_the_gateway_s_http_door(stack: RunningStack) -> None:
    """Last in this module: the gateway exits."""
    gateway = next(s for s in stack.services if s["role"] == "gateway")
    base, pid = str(gateway["http"]), int(gateway["pid"])  # type: ignore[call-overload]
    assert _http(base + "/health")[0] == 200
    body = {"model": MODEL, "prompt": "Tell me about rivers.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as in_flight:
        first = in_flight.readline()
        assert first.startswith(b"data: ")
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)
        health = _http(base + "/health")
        assert health[0] == 503 and json.loads(health[1])["status"] == "draining"
        status, text = _http(base + "/v1/completions", {"model": MODEL, "prompt": "new", "max_tokens": 2})
        assert status == 503 and json.loads(text)["error"]["code"] == "service_unavailable"
        rest = in_flight.read().decode()
    events = [line for line in (first.decode() + rest).split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finish = json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"]
    assert finish == "length"  # every token of the stream in flight came
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the gateway did not exit after its drain"

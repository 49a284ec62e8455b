"""Chaos: the stack as processes (`tandem up`, dummy:tiny) under faults, with bounded loops.

Scenarios: cancels at random points; malformed and hostile requests (hypothesis); SIGTERM of a decode
worker under load (drain); SIGKILL of the prefill worker mid-stream (decode prefills locally); a Redis
restart under load; SIGKILL of a decode worker mid-stream (the gateway resumes on the other one).
After every scenario: no stream outlived its deadline; every request got its full output, token-exact
against an undisturbed run, or one clear status; every live worker's KV pool is all free again.
The counts go to `chaos-report.json` (under pytest's temp dir, or `$TANDEM_CHAOS_REPORT`) and are printed;
`docs/reliability.md` quotes them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.test_stack import RunningStack, _alive, start_stack
from tests.metrics_text import scrape_total
from tests.redis_server import RedisServer, find_redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "dummy:tiny"
PROMPTS = [f"Chaos request {i}: tell me about {topic}." for i, topic in
           enumerate(["rivers", "stars", "trains", "bread", "glaciers", "owls"])]
MAX_TOKENS = 120  # ~1 s of decoding per request on two CPU cores: long enough to fault mid-stream
DEADLINE_S = 60.0
# Statuses a client may get from a hostile request: a clear refusal, never a hang or a crash.
CLEAR_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.NOT_FOUND}

REPORT: dict[str, dict[str, int]] = {}


@dataclass
class Outcome:
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    code: grpc.StatusCode | None = None  # None: the stream ended normally
    elapsed_s: float = 0.0
    cancelled_by_us: bool = False


def request_for(index: int, max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    """Even prompts greedy, odd ones seeded sampling: both must survive faults token-exact."""
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if index % 2 == 0:
        sampling.temperature = 0.0
    else:
        sampling.temperature, sampling.seed = 0.8, 1000 + index
    return generation_pb2.GenerateRequest(prompt=PROMPTS[index], sampling=sampling)


def run(address: str, index: int, *, cancel_after: int | None = None,
        on_tokens: Callable[[int], None] | None = None) -> Outcome:
    outcome = Outcome(index)
    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request_for(index), timeout=DEADLINE_S)
        try:
            for response in call:
                outcome.token_ids += response.token_ids
                outcome.finish_reason = response.finish_reason
                if on_tokens is not None:
                    on_tokens(len(outcome.token_ids))
                if cancel_after is not None and len(outcome.token_ids) >= cancel_after:
                    call.cancel()
                    outcome.cancelled_by_us = True
                    break
        except grpc.RpcError as error:
            outcome.code = error.code()  # type: ignore[attr-defined]
    outcome.elapsed_s = time.monotonic() - start
    return outcome


def run_all(address: str, indices: list[int], **kwargs: object) -> list[Outcome]:
    with ThreadPoolExecutor(len(indices)) as pool:
        return list(pool.map(lambda i: run(address, i, **kwargs), indices))  # type: ignore[arg-type]


class FaultWhenStreaming:
    """Calls `fault()` once, as soon as every one of `num_streams` streams has at least `min_tokens`."""

    def __init__(self, num_streams: int, min_tokens: int, fault: Callable[[], None]) -> None:
        self._counts: dict[int, int] = {}
        self._num_streams, self._min_tokens, self._fault = num_streams, min_tokens, fault
        self._lock = threading.Lock()
        self.fired = False

    def hook(self, stream: int) -> Callable[[int], None]:
        def on_tokens(count: int) -> None:
            with self._lock:
                self._counts[stream] = count
                ready = len(self._counts) == self._num_streams and min(self._counts.values()) >= self._min_tokens
                if ready and not self.fired:
                    self.fired = True
                    self._fault()
        return on_tokens


def run_with_fault(address: str, indices: list[int], min_tokens: int, fault: Callable[[], None]) -> list[Outcome]:
    trigger = FaultWhenStreaming(len(indices), min_tokens, fault)
    with ThreadPoolExecutor(len(indices)) as pool:
        outcomes = list(pool.map(lambda i: run(address, i, on_tokens=trigger.hook(i)), indices))
    assert trigger.fired, "the fault was never injected"
    return outcomes


def live_workers(stack: RunningStack) -> list[dict[str, object]]:
    return [s for s in stack.services if s["role"] != "gateway" and _alive(int(s["pid"]))]  # type: ignore[arg-type]


def pid_of(stack: RunningStack, role: str, index: int = 0) -> int:
    return int([s for s in stack.services if s["role"] == role][index]["pid"])  # type: ignore[arg-type]


def busiest_decode(stack: RunningStack) -> int:
    """The pid of the live decode worker holding the most KV blocks now: the one serving most streams (the
    gateway routes on a load view up to a heartbeat old, so one worker may be serving all of them)."""
    decodes = [s for s in live_workers(stack) if s["role"] == "decode"]
    busiest = min(decodes, key=lambda s: scrape(str(s["http"]), "tandem_kv_blocks_free"))
    return int(busiest["pid"])  # type: ignore[arg-type]


def gateway_resumes(stack: RunningStack) -> int:
    """How many times the gateway has moved a request to another decode worker (its log says so)."""
    log = Path(str(next(s for s in stack.services if s["role"] == "gateway")["log"]))
    return log.read_text(errors="replace").count(": resuming on ") if log.exists() else 0


def scrape(http: str, name: str) -> float:
    return scrape_total(http, name)


def check_invariants(stack: RunningStack, scenario: str, outcomes: list[Outcome], expected: dict[int, list[int]],
                     *, num_faults: int) -> None:
    """The invariants after every scenario, and the scenario's row of the report."""
    lost = []
    for outcome in outcomes:
        assert outcome.elapsed_s < DEADLINE_S + 5, f"{scenario}: a stream hung {outcome.elapsed_s:.0f} s"
        if outcome.cancelled_by_us:  # what it got before the cancel is a prefix of the full output
            assert outcome.token_ids == expected[outcome.prompt_index][:len(outcome.token_ids)]
            continue
        if outcome.code is not None or outcome.token_ids != expected[outcome.prompt_index]:
            lost.append(outcome)
    # Blocks come back within a bounded time on every worker still alive.
    deadline = time.monotonic() + 15
    while True:
        pools = {str(s["grpc"]): (scrape(str(s["http"]), "tandem_kv_blocks_free"),
                                  scrape(str(s["http"]), "tandem_kv_blocks_total")) for s in live_workers(stack)}
        if all(free == total for free, total in pools.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    REPORT[scenario] = {"requests": len(outcomes), "faults": num_faults, "lost": len(lost),
                        "completed": sum(o.code is None and not o.cancelled_by_us for o in outcomes),
                        "cancelled": sum(o.cancelled_by_us for o in outcomes), "live_workers": len(pools)}
    assert not lost, f"{scenario}: lost {[(o.prompt_index, o.code, len(o.token_ids)) for o in lost]}"
    assert all(free == total for free, total in pools.values()), f"{scenario}: blocks held {pools}"


@pytest.fixture(scope="module", autouse=True)
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    path = Path(os.environ.get("TANDEM_CHAOS_REPORT") or tmp_path_factory.getbasetemp() / "chaos-report.json")
    path.write_text(json.dumps(REPORT, indent=2) + "\n")
    print(f"\nchaos report ({path}):\n{json.dumps(REPORT, indent=2)}")


def undisturbed(stack: RunningStack) -> dict[int, list[int]]:
    outcomes = run_all(stack.address("gateway"), list(range(len(PROMPTS))))
    assert all(o.code is None and len(o.token_ids) == MAX_TOKENS for o in outcomes)
    return {o.prompt_index: o.token_ids for o in outcomes}


# -- stack 1: static registry, one prefill and two decode workers ------------------------------------------
@pytest.fixture(scope="module")
def static_stack() -> Iterator[tuple[RunningStack, dict[int, list[int]]]]:
    with tempfile.TemporaryDirectory() as tmp:
        for stack in start_stack(Path(tmp), model=MODEL, num_decode=2):
            yield stack, undisturbed(stack)


def test_random_cancels(static_stack: tuple[RunningStack, dict[int, list[int]]]) -> None:
    stack, expected = static_stack
    rng = random.Random(7)
    plan = [(i % len(PROMPTS), rng.choice([None, 1, 5, 20, 60])) for i in range(12)]
    with ThreadPoolExecutor(len(plan)) as pool:
        outcomes = list(pool.map(lambda p: run(stack.address("gateway"), p[0], cancel_after=p[1]), plan))
    check_invariants(stack, "random cancels", outcomes, expected,
                     num_faults=sum(o.cancelled_by_us for o in outcomes))


HOSTILE_SEEN: list[str] = []


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_requests_get_a_clear_status(static_stack: tuple[RunningStack, dict[int, list[int]]],
                                             data: st.DataObject) -> None:
    stack, _ = static_stack
    request = generation_pb2.GenerateRequest(
        request_id=data.draw(st.text(max_size=40)),  # a fresh stream each: ids may repeat across calls
        model=data.draw(st.sampled_from(["", MODEL, "gpt-4", "dummy:tiny ", "\x00"])))
    kind = data.draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        request.prompt = data.draw(st.text(min_size=1, max_size=64) | st.text(max_size=64)
                                   | st.just("x " * 3000))
    elif kind == "ids":
        request.prompt_token_ids.ids.extend(data.draw(st.lists(
            st.integers(-2**31, 2**31 - 1) | st.integers(0, 49151), max_size=20)))
    elif kind == "messages":
        for role, content in data.draw(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "evil"]),
                                                          st.text(max_size=30)), max_size=3)):
            request.messages.messages.add(role=role, content=content)
    sampling = request.sampling
    # Each field: unset, a plausible value, or a hostile one. max_tokens stays small or past the context,
    # so an accepted request ends quickly.
    for name, valid, hostile in [
            ("max_tokens", st.integers(1, 8), st.just(0) | st.integers(1024, 2**32 - 1)),
            ("temperature", st.floats(0, 2, width=32), st.floats(width=32)),
            ("top_p", st.floats(0.125, 1, width=32), st.floats(width=32)),
            ("top_k", st.integers(0, 50), st.integers(-2**31, 2**31 - 1)),
            ("seed", st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))]:
        choice = data.draw(st.sampled_from(["unset", "valid", "valid", "hostile"]))
        if choice != "unset" or name == "max_tokens":
            setattr(sampling, name, data.draw(hostile if choice == "hostile" else valid))
    sampling.stop.extend(data.draw(st.lists(st.text(max_size=5), max_size=2)))
    sampling.stop_token_ids.extend(data.draw(st.lists(st.integers(0, 49151) | st.integers(-2**31, 2**31 - 1),
                                                      max_size=2)))
    start = time.monotonic()
    code = None
    with grpc.insecure_channel(stack.address("gateway")) as channel:
        try:
            responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=20))
            assert responses and responses[-1].finish_reason != 0, "a stream that ended without a finish"
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            assert code in CLEAR_REFUSALS, f"{code}: {error.details()}"  # type: ignore[attr-defined]
            assert error.details(), "a refusal must say why"  # type: ignore[attr-defined]
    assert time.monotonic() - start < 20
    HOSTILE_SEEN.append("ok" if code is None else code.name)


def test_stack_serves_after_hostile_requests(static_stack: tuple[RunningStack, dict[int, list[int]]]) -> None:
    stack, expected = static_stack
    assert HOSTILE_SEEN, "run with the hostile test"
    outcomes = run_all(stack.address("gateway"), list(range(len(PROMPTS))))
    check_invariants(stack, "hostile requests", outcomes, expected, num_faults=len(HOSTILE_SEEN))
    REPORT["hostile requests"]["hostile"] = len(HOSTILE_SEEN)
    REPORT["hostile requests"]["refused"] = sum(seen != "ok" for seen in HOSTILE_SEEN)
    REPORT["hostile requests"]["served"] = HOSTILE_SEEN.count("ok")


def test_sigterm_drains_a_decode_worker_under_load(static_stack: tuple[RunningStack, dict[int, list[int]]]) -> None:
    stack, expected = static_stack
    drained: list[int] = []

    def drain() -> None:
        drained.append(busiest_decode(stack))
        os.kill(drained[0], signal.SIGTERM)

    outcomes = run_with_fault(stack.address("gateway"), list(range(len(PROMPTS))), 5, drain)
    draining = drained[0]
    deadline = time.monotonic() + 35  # the worker's --drain-s is 30
    while _alive(draining) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(draining), "the drained worker did not exit"
    # New requests go to the worker left.
    outcomes += run_all(stack.address("gateway"), [0, 1])
    check_invariants(stack, "SIGTERM decode under load", outcomes, expected, num_faults=1)


def test_sigkill_prefill_mid_stream(static_stack: tuple[RunningStack, dict[int, list[int]]]) -> None:
    stack, expected = static_stack
    prefill = pid_of(stack, "prefill")
    gateway = stack.address("gateway")
    # Staggered arrivals, so some requests are being prefilled when the worker dies and some come after.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = []
        for i in range(len(PROMPTS)):
            futures.append(pool.submit(run, gateway, i))
            if i == 2:
                os.kill(prefill, signal.SIGKILL)
            time.sleep(0.05)
        outcomes = [f.result() for f in futures]
    assert not _alive(prefill)
    check_invariants(stack, "SIGKILL prefill mid-stream", outcomes, expected, num_faults=1)
    local = sum(scrape(str(s["http"]), "tandem_decode_local_prefill_tokens_total")
                for s in live_workers(stack) if s["role"] == "decode")
    assert local > 0, "no decode worker prefilled locally"
    REPORT["SIGKILL prefill mid-stream"]["local_prefill_tokens"] = int(local)


# -- stack 2: Redis registry, one prefill and two decode workers -------------------------------------------
@pytest.fixture(scope="module")
def redis_stack() -> Iterator[tuple[RunningStack, dict[int, list[int]], RedisServer]]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary")
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(binary, Path(tmp))
        redis.start()
        try:
            for stack in start_stack(Path(tmp), "--redis", redis.url, model=MODEL, num_decode=2):
                yield stack, undisturbed(stack), redis
        finally:
            redis.stop()


def test_redis_restart_under_load(redis_stack: tuple[RunningStack, dict[int, list[int]], RedisServer]) -> None:
    stack, expected, redis = redis_stack

    def restart() -> None:
        redis.stop()
        time.sleep(1.0)
        redis.start()

    outcomes = run_with_fault(stack.address("gateway"), list(range(len(PROMPTS))), 5, restart)
    time.sleep(3)  # past the workers' next heartbeat: re-registered
    outcomes += run_all(stack.address("gateway"), list(range(len(PROMPTS))))
    check_invariants(stack, "Redis restart under load", outcomes, expected, num_faults=1)


def test_sigkill_decode_mid_stream_resumes_token_exact(
        redis_stack: tuple[RunningStack, dict[int, list[int]], RedisServer]) -> None:
    stack, expected, _ = redis_stack
    killed: list[int] = []
    resumes_before = gateway_resumes(stack)

    def kill() -> None:
        killed.append(busiest_decode(stack))
        os.kill(killed[0], signal.SIGKILL)

    outcomes = run_with_fault(stack.address("gateway"), list(range(len(PROMPTS))), 10, kill)
    num_resumed = gateway_resumes(stack) - resumes_before
    assert num_resumed >= 1, "no stream was on the killed worker"
    assert not _alive(killed[0])
    outcomes += run_all(stack.address("gateway"), [0, 1])  # the dead worker's key may not have lapsed yet
    check_invariants(stack, "SIGKILL decode mid-stream", outcomes, expected, num_faults=1)
    REPORT["SIGKILL decode mid-stream"]["resumed_mid_stream"] = num_resumed

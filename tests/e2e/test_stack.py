"""The whole stack as processes (`tandem up`): gateway → prefill → decode on SmolLM2-135M."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.launcher import free_port
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.metrics_text import scrape_total
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
]
MAX_TOKENS = 24



class RunningStack:
    def __init__(self, process: subprocess.Popen[bytes], status: dict[str, list[dict[str, object]]]) -> None:
        self.process = process
        self.services = status["services"]

    def address(self, role: str) -> str:
        return str(next(s for s in self.services if s["role"] == role)["grpc"])

    def metric(self, role: str, name: str, labels: Mapping[str, str] | None = None) -> float:
        return scrape_total(str(next(s for s in self.services if s["role"] == role)["http"]), name, labels)


def start_stack(tmp_path: Path, *extra: str, model: str = "smollm2-135m", num_prefill: int = 1,
                num_decode: int = 1) -> Iterator[RunningStack]:
    """`tandem up` as a process; yields once every service is healthy, SIGTERMs it afterwards."""
    status_file = tmp_path / "status.json"
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "tandem.cli", "up", "--model", model, "--prefill", str(num_prefill),
               "--decode", str(num_decode), "--port", str(port), "--http-port", str(free_port("127.0.0.1")),
               "--status-file", str(status_file), "--max-model-len", "1024", *extra]
    env = dict(os.environ, TANDEM_HOME=os.environ.get("TANDEM_HOME", str(Path.home() / ".cache" / "tandem")))
    log = (tmp_path / "up.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not status_file.exists():
            assert process.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "stack not up after 300 s"
            time.sleep(0.5)
        yield RunningStack(process, json.loads(status_file.read_text()))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def chat_request(prompt: str) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0))
    request.messages.messages.add(role="user", content=prompt)
    return request


def stream(address: str, request: generation_pb2.GenerateRequest) -> tuple[list[int], str, list[float], object]:
    """Token ids, text, arrival time of each message, and the last message."""
    with grpc.insecure_channel(address) as channel:
        token_ids: list[int] = []
        text = ""
        arrivals: list[float] = []
        last = None
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request):
            arrivals.append(time.perf_counter())
            token_ids += response.token_ids
            text += response.text
            last = response
    return token_ids, text, arrivals, last


@pytest.fixture(scope="module")
def expected(smollm2_path: Path) -> list[tuple[list[int], str]]:
    torch.set_num_threads(1)  # as each worker of `tandem up` runs
    llm = LLM("smollm2-135m", max_model_len=1024, max_num_batched_tokens=1024)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [(o.token_ids, o.text) for o in outputs]


def check_stack(stack: RunningStack, expected: list[tuple[list[int], str]]) -> None:
    gateway = stack.address("gateway")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: stream(gateway, chat_request(p)), PROMPTS))
    for (token_ids, text, _, last), (expected_ids, expected_text) in zip(results, expected, strict=True):
        assert token_ids == expected_ids
        assert text == expected_text
        assert last.usage.completion_tokens == len(expected_ids)  # type: ignore[attr-defined]
    # Every prompt was prefilled by the prefill worker and its pages shipped.
    assert stack.metric("decode", "tandem_decode_local_prefill_tokens_total") == 0
    assert stack.metric("decode", "tandem_kv_transfer_bytes_total") > 0
    assert stack.metric("decode", "tandem_kv_blocks_free") == stack.metric("decode", "tandem_kv_blocks_total")


def test_static_stack_matches_in_process_and_streams(tmp_path: Path, smollm2_path: Path,
                                                     expected: list[tuple[list[int], str]]) -> None:
    for stack in start_stack(tmp_path):
        check_stack(stack, expected)
        # Streaming: tokens arrive as they are made, spread over the generation, not all at the end.
        request = chat_request("Count from one to twenty in words.")
        request.sampling.max_tokens = 40
        request.sampling.ignore_eos = True
        token_ids, _, arrivals, _ = stream(stack.address("gateway"), request)
        assert len(token_ids) == 40
        assert len(arrivals) >= 20
        assert arrivals[len(arrivals) // 2] - arrivals[0] > 0.25 * (arrivals[-1] - arrivals[0])
        # Ending the stack (SIGTERM) stops every process.
    for service in stack.services:
        pid = int(service["pid"])  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"{service['role']} still running"


def test_redis_stack_matches_in_process(tmp_path: Path, smollm2_path: Path, redis_server: RedisServer,
                                        expected: list[tuple[list[int], str]]) -> None:
    for stack in start_stack(tmp_path, "--redis", redis_server.url):
        check_stack(stack, expected)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by `tandem up`) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False

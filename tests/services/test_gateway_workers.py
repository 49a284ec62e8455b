"""`tandem gateway --workers N`: several gateway processes on one gRPC and one HTTP port (SO_REUSEPORT), run as the
command runs them, over fake decode workers in this process (real gRPC on loopback). Concurrent clients on many
connections get every stream complete and in order; cancels, deadlines and a drain reach the decode worker through
whichever process took the connection; `/metrics` reports every process, whichever answers; spans come from each
process; a process that dies is started again. And the sessions' channels are `make_channel`'s with a fixed window.

Connections, not streams, are spread among the processes (by the kernel's hash of their addresses), so each test
opens connections until the fake decode worker has seen requests from every process's own session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from prometheus_client.parser import text_string_to_metric_families

from tandem.gateway.workers import default_num_workers
from tandem.serving.rpc import start_server
from tandem.serving.service import SESSION_HEARTBEAT_S
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.metrics_text import metric_total
from tests.otlp_receiver import OtlpReceiver, attributes_of
from tests.unit.test_limits import fake_token

MODEL = "dummy:tiny"  # the gateways load only its (SmolLM2) tokenizer; the fake decode worker computes nothing
NUM_WORKERS = 2


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """Streams `fake_token`s (`delay_s` apart) for every started request, and records what each session (one per
    gateway process) asked: starts (with their deadline and trace context) and cancels."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.num_sessions = 0
        self.session_of: dict[str, int] = {}  # worker request id → the session that started it
        self.starts: dict[str, worker_pb2.SessionStart] = {}
        self.cancels: list[str] = []

    def sessions_used(self, prefix: str = "") -> set[int]:
        return {session for request_id, session in self.session_of.items() if request_id.startswith(prefix)}

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(role="decode", model=MODEL, layout=worker_pb2.KVLayout(model_fingerprint="fake"),
                                     num_free_blocks=1000, num_total_blocks=1000, max_model_len=2048,
                                     vocab_size=49152)

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SessionResponse]:
        self.num_sessions += 1
        session = self.num_sessions
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
                    request_id = message.start.request.request_id
                    self.session_of[request_id] = session
                    self.starts[request_id] = message.start
                    tasks[request_id] = asyncio.ensure_future(run(message.start.request))
                elif message.WhichOneof("kind") == "cancel":  # acks (the gateway's flow control) are ignored here
                    self.cancels.append(message.cancel.request_id)
                    if (task := tasks.pop(message.cancel.request_id, None)) is not None:
                        task.cancel()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                try:
                    async with asyncio.timeout(SESSION_HEARTBEAT_S):
                        updates = [await out.get()]
                except TimeoutError:
                    if reader.done() and not tasks:
                        return
                    yield worker_pb2.SessionResponse()
                    continue
                while not out.empty():
                    updates.append(out.get_nowait())
                yield worker_pb2.SessionResponse(updates=updates)
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()


@dataclass
class Gateway:
    process: asyncio.subprocess.Process
    grpc: str
    http: str
    log: Path
    output: list[str] = field(default_factory=list)

    def workers(self) -> list[int]:
        """The pids of the gateway processes under the supervisor (not multiprocessing's resource tracker)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if parent == self.process.pid and b"spawn_main" in command:
                pids.append(int(entry))
        return sorted(pids)


@contextlib.asynccontextmanager
async def fake_decode() -> AsyncIterator[tuple[FakeDecode, str]]:
    servicer = FakeDecode()

    def register(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        return ["tandem.v1.Decode"]

    server, port, _ = await start_server("127.0.0.1:0", register)
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def gateway_processes(tmp_path: Path, decode: str, *extra: str, env: dict[str, str] | None = None,
                            ) -> AsyncIterator[Gateway]:
    """`tandem gateway --workers 2` on ports 0 (the supervisor picks them once for both processes), until its
    supervisor's ready line; SIGTERM at the end if it still runs."""
    log = tmp_path / "gateway.log"
    with log.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.cli", "gateway", "--model", MODEL, "--decode", decode, "--port", "0",
            "--http-port", "0", "--workers", str(NUM_WORKERS), "--drain-s", "10", *extra,
            stdout=asyncio.subprocess.PIPE, stderr=log_file, env={**os.environ, **(env or {})})
    assert process.stdout is not None
    output: list[str] = []
    try:
        async with asyncio.timeout(120):
            while "workers=" not in (line := (await process.stdout.readline()).decode()):
                assert line, f"the gateway exited: {log.read_text()}"
                output.append(line)
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        assert fields["workers"] == str(NUM_WORKERS)
        gateway = Gateway(process, fields["grpc"], fields["http"], log, output)
        # Each process printed its own ready line first, for the same ports (their lines may interleave).
        assert "".join(output).count(f"ready grpc={gateway.grpc} ") == NUM_WORKERS, output
        reader = asyncio.ensure_future(_read_all(process.stdout, output))
        try:
            yield gateway
        finally:
            reader.cancel()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _read_all(stream: asyncio.StreamReader, into: list[str]) -> None:
    while line := await stream.readline():
        into.append(line.decode())


def connection(address: str) -> grpc.aio.Channel:
    """A channel with a connection of its own (channels to one address would share one otherwise)."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def generate_request(request_id: str, prompt: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=request_id, sampling=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0))
    request.prompt_token_ids.ids.extend(prompt)
    return request


async def until_every_process(fake: FakeDecode, prefix: str, action: Callable[[int], Awaitable[None]],
                              limit: int = 64) -> int:
    """Run `action(i)` for i = 0, 1, ... (each on a connection of its own) until requests whose id starts with
    `prefix` came through every gateway process's session; the number of actions run."""
    for i in range(limit):
        await action(i)
        if len(fake.sessions_used(prefix)) == NUM_WORKERS:
            return i + 1
    raise AssertionError(f"{limit} connections all went to the same processes: {fake.sessions_used(prefix)}")


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def scrape(http: str) -> str:
    return await asyncio.to_thread(lambda: urllib.request.urlopen(http + "/metrics", timeout=5).read().decode())


def test_default_worker_count_from_the_cpus() -> None:
    assert [default_num_workers(cpus) for cpus in (1, 2, 4, 7, 8, 12, 16, 64, 256)] == [1, 1, 1, 1, 2, 3, 4, 4, 4]
    assert default_num_workers() >= 1


async def test_processes_on_one_port_serve_concurrent_clients_every_stream_complete_in_order(
        tmp_path: Path) -> None:
    async with fake_decode() as (fake, decode), gateway_processes(tmp_path, decode) as gateway:
        fake.delay_s = 0.002
        prompts = [[1000 + 7 * i + j for j in range(5 + i % 4)] for i in range(64)]
        lengths = [8 + (i * 5) % 24 for i in range(64)]
        channels = [connection(gateway.grpc) for _ in range(16)]
        try:
            async def one(i: int) -> list[int]:
                stub = generation_pb2_grpc.GenerationStub(channels[i % len(channels)])
                tokens: list[int] = []
                async for response in stub.Generate(generate_request(f"c{i}", prompts[i], lengths[i]), timeout=60):
                    tokens += response.token_ids
                    assert bool(response.finish_reason) == (len(tokens) == lengths[i])  # the end comes last
                return tokens

            # 64 concurrent streams over 16 connections, each connection with several streams at once.
            results = await asyncio.gather(*(one(i) for i in range(64)))
            for i, tokens in enumerate(results):
                assert tokens == [fake_token(prompts[i], p) for p in range(lengths[i])], f"stream {i}"
            if len(fake.sessions_used("c")) < NUM_WORKERS:  # unlikely with 16 connections: open more until so
                async def more(i: int) -> None:
                    async with connection(gateway.grpc) as channel:
                        stub = generation_pb2_grpc.GenerationStub(channel)
                        tokens = [t async for r in stub.Generate(generate_request(f"c-more{i}", prompts[0], 4))
                                  for t in r.token_ids]
                        assert tokens == [fake_token(prompts[0], p) for p in range(4)]

                await until_every_process(fake, "c", more)
            # One session per process to the decode worker, each used.
            assert fake.num_sessions == NUM_WORKERS
            assert not fake.cancels  # every request ended by itself: nothing to cancel
        finally:
            for channel in channels:
                await channel.close()


async def test_cancel_and_deadline_reach_decode_through_every_process(tmp_path: Path) -> None:
    async with fake_decode() as (fake, decode), gateway_processes(tmp_path, decode) as gateway:
        fake.delay_s = 0.05  # 200 tokens: 10 s, far longer than any of these requests lives
        prompt = [1000, 1001, 1002]

        async def cancel(i: int) -> None:
            async with connection(gateway.grpc) as channel:
                call = generation_pb2_grpc.GenerationStub(channel).Generate(
                    generate_request(f"cancel{i}-", prompt, 200), timeout=30)
                received = [await call.read() for _ in range(2)]
                assert [t for r in received for t in r.token_ids] == [fake_token(prompt, p) for p in range(2)]
                call.cancel()
            # The gateway process that had it stops it on the decode worker (which frees its blocks).
            await wait_until(lambda: any(c.startswith(f"cancel{i}-#") for c in fake.cancels))

        await until_every_process(fake, "cancel", cancel)

        async def deadline(i: int) -> None:
            async with connection(gateway.grpc) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in stub.Generate(generate_request(f"deadline{i}-", prompt, 200), timeout=0.5):
                        pass
                assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - started < 5
            request_id = next(r for r in fake.starts if r.startswith(f"deadline{i}-#"))
            # The decode worker was told what was left of the client's deadline (gRPC sends it in whole units: a
            # hair over 0.5 s may come back), and the request was stopped there.
            assert 0 < fake.starts[request_id].timeout_s <= 0.55
            await wait_until(lambda: request_id in fake.cancels)

        await until_every_process(fake, "deadline", deadline)


async def test_sigterm_drains_every_process_and_spans_come_from_each(tmp_path: Path) -> None:
    """SIGTERM to the supervisor: every process stops taking requests while its streams in flight finish, then all
    exit; each process exported its spans (told apart by `tandem.gateway.worker`), and the decode worker got each
    request's trace context."""
    receiver = await RecordingOtlpReceiver.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    try:
        async with fake_decode() as (fake, decode), gateway_processes(tmp_path, decode, env=env) as gateway:
            fake.delay_s = 0.04  # 40 tokens: 1.6 s per stream
            prompt = [1000, 1001, 1002, 1003]
            channels: list[grpc.aio.Channel] = []
            streams: list[tuple[list[int], asyncio.Task[list[int]]]] = []  # (first tokens, the rest)

            async def read_all(call: Any) -> list[int]:
                tokens: list[int] = []
                while (response := await call.read()) != grpc.aio.EOF:
                    tokens += response.token_ids
                return tokens

            async def start(i: int) -> None:
                channel = connection(gateway.grpc)
                channels.append(channel)
                call = generation_pb2_grpc.GenerationStub(channel).Generate(
                    generate_request(f"drain{i}-", prompt, 40), timeout=30)
                first = await call.read()  # in flight on the decode worker now
                streams.append((list(first.token_ids), asyncio.ensure_future(read_all(call))))

            await until_every_process(fake, "drain", start)
            workers = gateway.workers()
            assert len(workers) == NUM_WORKERS
            gateway.process.send_signal(signal.SIGTERM)
            # A new request is refused by every process (a connection to a port nobody listens on any more, or
            # UNAVAILABLE from a process that is draining), while the streams in flight go on.
            await asyncio.sleep(0.3)
            for i in range(4):
                async with connection(gateway.grpc) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await generation_pb2_grpc.GenerationStub(channel).Generate(
                            generate_request(f"late{i}", prompt, 4), timeout=5).read()
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            for first, rest in streams:
                assert first + await rest == [fake_token(prompt, p) for p in range(40)]
            for channel in channels:
                await channel.close()
            assert await asyncio.wait_for(gateway.process.wait(), 30) == 0
            assert not [pid for pid in workers if _alive(pid)]
            assert not fake.sessions_used("late")
            # Every request's trace context reached the decode worker, in its start message.
            assert all("traceparent" in start.trace_context for start in fake.starts.values())
        # Each process's spans (flushed as it stopped), with its index; one `generate` per request.
        generate = [(span, worker) for span, worker in receiver.received if span.name == "generate"]
        assert {worker for _, worker in generate} == {str(i) for i in range(NUM_WORKERS)}
        traced = {span.attributes["tandem.request_id"] for span, _ in generate}
        assert {r.partition("#")[0] for r in fake.starts} <= traced
    finally:
        await receiver.stop()


async def test_metrics_of_every_process_whichever_answers(tmp_path: Path) -> None:
    async with fake_decode() as (fake, decode), gateway_processes(tmp_path, decode) as gateway:
        prompt = [1000, 1001]

        async def request(i: int) -> None:
            async with connection(gateway.grpc) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                assert len([r async for r in stub.Generate(generate_request(f"m{i}-", prompt, 3))]) >= 1

        num_requests = await until_every_process(fake, "m", request)
        workers = gateway.workers()
        for _ in range(6):  # each scrape a new connection: any process may answer, each must report all
            families = list(text_string_to_metric_families(await scrape(gateway.http)))
            text_requests = sum(s.value for f in families for s in f.samples
                                if s.name == "tandem_requests_total" and s.labels.get("status") == "length")
            assert text_requests == num_requests
            assert metric_total(await scrape(gateway.http), "tandem_e2e_request_latency_seconds_count") == num_requests
            # A gauge: one series per process.
            pids = {s.labels["pid"] for f in families for s in f.samples if s.name == "tandem_gateway_workers_refused"}
            assert pids == {str(pid) for pid in workers}


async def test_a_process_that_dies_is_started_again(tmp_path: Path) -> None:
    async with fake_decode() as (fake, decode), gateway_processes(tmp_path, decode) as gateway:
        before = gateway.workers()
        os.kill(before[0], signal.SIGKILL)
        await wait_until(lambda: len(set(gateway.workers()) - set(before)) == 1, timeout_s=30)
        await wait_until(lambda: "is serving again" in gateway.log.read_text(), timeout_s=60)
        assert before[1] in gateway.workers()  # the other one served on meanwhile

        async def request(i: int) -> None:
            async with connection(gateway.grpc) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                tokens = [t async for r in stub.Generate(generate_request(f"r{i}-", [1000], 3)) for t in r.token_ids]
                assert tokens == [fake_token([1000], p) for p in range(3)]

        # Both processes serve: the survivor's session and the new process's own one.
        await until_every_process(fake, "r", request)


class RecordingOtlpReceiver(OtlpReceiver):
    """An OTLP receiver that also keeps each span's `tandem.gateway.worker` resource attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[Any, str]] = []

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        from tests.otlp_receiver import ReceivedSpan

        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                self.received += [(ReceivedSpan.of(str(resource.get("service.name", "")), span),
                                   str(resource.get("tandem.gateway.worker", ""))) for span in scope_spans.spans]
        return await super().Export(request, context)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_session_channels_are_make_channel_s_but_for_a_fixed_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """`session_channel` copies `make_channel`'s options (keepalive, message limits) and turns BDP probing off: if
    `make_channel` changes, this says to change the sessions' channel with it."""
    from tandem.gateway.sessions import SESSION_WINDOW_BYTES, session_channel
    from tandem.serving.rpc import make_channel

    made: list[list[tuple[str, Any]]] = []
    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda address, options: made.append(list(options)))
    make_channel("127.0.0.1:1")
    session_channel("127.0.0.1:1")
    assert made[1] == [*made[0], ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", SESSION_WINDOW_BYTES)]

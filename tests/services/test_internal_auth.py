"""Service-to-service authentication (#12, item 2), with the real worker and gateway `serve` functions in-process over
gRPC on loopback (dummy:tiny): every internal RPC needs the stack's token (health checks and reflection stay open),
the gateway and decode send it, decode dials only the prefill workers it was given or the registry lists, a worker
beyond loopback refuses to start without authentication, and `tandem up` / compose hand every service the token."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from typer.testing import CliRunner

from tandem.cli import app
from tandem.common.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.decode_svc import server as decode_server
from tandem.gateway.server import serve as serve_gateway
from tandem.launcher import Stack, StackOptions
from tandem.models import load_model_config
from tandem.prefill_svc import server as prefill_server
from tandem.serving import metrics
from tandem.serving.auth import (
    INTERNAL_TOKEN_ENV,
    INTERNAL_TOKEN_FILE_ENV,
    METADATA_KEY,
    generate_token,
    is_loopback,
    load_internal_token,
)
from tandem.serving.registry import RedisRegistry
from tandem.serving.rpc import TlsConfig, make_channel
from tandem.serving.service import ServiceOptions
from tandem.serving.wire import sampling_to_worker
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.redis_server import RedisServer
from tests.unit.test_compose import PROJECTS, _parse, load

MODEL = "dummy:tiny"
PROMPT = list(range(100, 140))
TOKEN = generate_token()


def engine_config() -> EngineConfig:
    return EngineConfig(model=load_model_config(MODEL), cache=CacheConfig(block_size=16, num_blocks=64),
                        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=512))


@dataclass
class Running:
    """A service's `serve` running in this process until `stop` is set."""

    address: str
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)


async def start(serve: Callable[[Callable[[str, int], None], asyncio.Event], Awaitable[None]]) -> Running:
    stop = asyncio.Event()
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(lambda address, http_port: started.set_result(address), stop))
    done, _ = await asyncio.wait({task, started}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises what stopped it
    return Running(started.result(), stop, task)


def options(role: str, token: str | None, **fields: Any) -> ServiceOptions:
    return ServiceOptions(role=role, port=0, http_port=0, drain_s=0.0, internal_token=token, **fields)


async def start_prefill(token: str | None, **fields: Any) -> Running:
    return await start(lambda on_started, stop: prefill_server.serve(
        options("prefill", token, **fields), engine_config(), MODEL, on_started=on_started, stop=stop))


async def start_decode(token: str | None, prefill_peers: list[str], **fields: Any) -> Running:
    return await start(lambda on_started, stop: decode_server.serve(
        options("decode", token, **fields), engine_config(), MODEL, prefill_peers=prefill_peers,
        on_started=on_started, stop=stop))


async def start_gateway(token: str | None, prefill: list[str], decode: list[str]) -> Running:
    return await start(lambda on_started, stop: serve_gateway(
        options("gateway", token), MODEL, prefill, decode, 256, on_started=on_started, stop=stop))


@pytest.fixture
async def stack() -> AsyncIterator[tuple[Running, Running]]:
    """A prefill and a decode worker sharing TOKEN; decode was given the prefill worker's address."""
    interval = sys.getswitchinterval()  # the prefill worker sets the process's
    prefill = await start_prefill(TOKEN)
    decode = await start_decode(TOKEN, [prefill.address])
    yield prefill, decode
    await decode.close()
    await prefill.close()
    sys.setswitchinterval(interval)


def decode_request(req_id: str, prefill_address: str, max_tokens: int = 8, prompt: list[int] = PROMPT
                   ) -> worker_pb2.DecodeRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    return worker_pb2.DecodeRequest(request_id=req_id, prompt_token_ids=prompt, sampling=sampling_to_worker(params),
                                    prefill_address=prefill_address)


# Another prompt of PROMPT's length, none of whose blocks a worker that served PROMPT has cached.
OTHER_PROMPT = [token + 100 for token in PROMPT]


async def generate(address: str, request: worker_pb2.DecodeRequest, token: str | None = TOKEN
                   ) -> tuple[list[int], int]:
    """Token ids of one `Decode.Generate` stream, and how many prompt tokens decode computed itself."""
    async with make_channel(address, internal_token=token) as channel:
        tokens: list[int] = []
        local = 0
        async for response in worker_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60):
            local += response.num_local_prefill_tokens
            tokens += response.token_ids
    return tokens, local


async def status_of(call: Awaitable[Any] | AsyncIterator[Any]) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[union-attr]
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def local_prefill_tokens(reason: str) -> float:
    return metrics.LOCAL_PREFILL_TOKENS.labels(reason=reason)._value.get()


# -- the workers require the token -------------------------------------------------------------------------------
async def test_every_internal_rpc_needs_the_token(stack: tuple[Running, Running]) -> None:
    prefill, decode = stack

    async def session_status(channel: grpc.aio.Channel) -> None:
        # The server decides on the call's metadata alone, so nothing is written: with a request iterator, grpc's
        # client reports a write that loses the race with the server's refusal as INTERNAL ("Failed execute_batch"),
        # hiding the server's status (seen in CI, about 1 call in 14 on this VM).
        call = worker_pb2_grpc.DecodeStub(channel).Session(timeout=10)
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                                       await call.details())

    calls: dict[str, Callable[[grpc.aio.Channel, grpc.aio.Channel], Any]] = {
        "Prefill.Info": lambda p, d: worker_pb2_grpc.PrefillStub(p).Info(worker_pb2.InfoRequest(), timeout=10),
        "Prefill.Prefill": lambda p, d: worker_pb2_grpc.PrefillStub(p).Prefill(
            worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=PROMPT), timeout=10),
        "Prefill.Release": lambda p, d: worker_pb2_grpc.PrefillStub(p).Release(
            worker_pb2.ReleaseRequest(request_id="x"), timeout=10),
        "Prefill.OpenPool": lambda p, d: worker_pb2_grpc.PrefillStub(p).OpenPool(
            worker_pb2.OpenPoolRequest(pool_id="x"), timeout=10),
        "Decode.Info": lambda p, d: worker_pb2_grpc.DecodeStub(d).Info(worker_pb2.InfoRequest(), timeout=10),
        "Decode.Generate": lambda p, d: worker_pb2_grpc.DecodeStub(d).Generate(
            decode_request("g", prefill.address), timeout=10),
        "Decode.Session": lambda p, d: session_status(d),
    }
    served_before = metrics.PREFILL_PROMPT_TOKENS._value.get()
    for token in (None, generate_token(), TOKEN[:-1] + ("0" if TOKEN[-1] != "0" else "1")):  # none, another, near
        async with make_channel(prefill.address, internal_token=token) as p, \
                make_channel(decode.address, internal_token=token) as d:
            for name, call in calls.items():
                assert await status_of(call(p, d)) == grpc.StatusCode.UNAUTHENTICATED, (name, token)
    assert metrics.PREFILL_PROMPT_TOKENS._value.get() == served_before  # no handler ran

    # Health checks and reflection stay open: probes and discovery carry no token.
    for address, service in ((prefill.address, "tandem.v1.Prefill"), (decode.address, "tandem.v1.Decode")):
        async with make_channel(address) as channel:
            for name in ("", service):
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                                         timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            listed = set()
            async for answer in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10):
                listed |= {s.name for s in answer.list_services_response.service}
            assert service in listed

    # With the token: answered (and the token is an ordinary metadata entry, however the caller sends it).
    async with make_channel(prefill.address, internal_token=TOKEN) as p, make_channel(decode.address) as d:
        assert (await worker_pb2_grpc.PrefillStub(p).Info(worker_pb2.InfoRequest(), timeout=10)).role == "prefill"
        info = await worker_pb2_grpc.DecodeStub(d).Info(worker_pb2.InfoRequest(), timeout=10,
                                                        metadata=((METADATA_KEY, TOKEN),))
        assert info.role == "decode"


async def test_the_gateway_and_decode_send_the_token(stack: tuple[Running, Running]) -> None:
    prefill, decode = stack
    # Decode → prefill carries the token: the prompt was computed by the prefill worker.
    tokens, local = await generate(decode.address, decode_request("remote", prefill.address))
    assert len(tokens) == 8 and local == 0

    # Gateway → decode (its probes and its sessions) carries it: served through the public port, which needs none.
    gateway = await start_gateway(TOKEN, [prefill.address], [decode.address])
    try:
        async with make_channel(gateway.address) as channel:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
                sampling=generation_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=0))
            served: list[int] = []
            async for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
                served += response.token_ids
        assert served == tokens
    finally:
        await gateway.close()

    # A gateway without the stack's token finds no worker that answers it: nothing is served.
    stranger = await start_gateway(None, [prefill.address], [decode.address])
    try:
        async with make_channel(stranger.address) as channel:
            code = await status_of(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await stranger.close()


async def test_a_decode_worker_with_the_wrong_token_prefills_locally(stack: tuple[Running, Running]) -> None:
    prefill, _ = stack
    before = local_prefill_tokens("transfer_refused")
    other = generate_token()
    decode = await start_decode(other, [prefill.address])
    try:
        tokens, local = await generate(decode.address, decode_request("refused", prefill.address), token=other)
    finally:
        await decode.close()
    assert len(tokens) == 8 and local == len(PROMPT)  # served all the same, and counted
    assert local_prefill_tokens("transfer_refused") - before == len(PROMPT)


# -- decode dials only known prefill workers ---------------------------------------------------------------------
@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP port on loopback that counts the connections made to it (what an attacker's server would see)."""
    connections: list[int] = []

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", connections
    finally:
        server.close()
        await server.wait_closed()


async def test_decode_never_dials_an_address_taken_from_a_request(stack: tuple[Running, Running]) -> None:
    prefill, decode = stack
    before = local_prefill_tokens("unknown_prefill_worker")
    async with listener() as (rogue, connections):
        tokens, local = await generate(decode.address, decode_request("rogue", rogue))
        await asyncio.sleep(0.2)  # a connection attempt would have landed by now
        assert connections == []
    assert local == len(PROMPT) and len(tokens) == 8  # computed here instead
    assert local_prefill_tokens("unknown_prefill_worker") - before == len(PROMPT)
    # The known prefill worker is still used.
    _, remote_local = await generate(decode.address, decode_request("known", prefill.address, prompt=OTHER_PROMPT))
    assert remote_local == 0


async def test_decode_dials_prefill_workers_the_registry_lists(redis_server: RedisServer) -> None:
    """Through a Redis registry with a password (credentials in the URL): a prefill worker that registered there
    is dialled, an address that is not there is not; a client without the password can neither read nor write."""
    password = generate_token()
    admin = aioredis.Redis(port=redis_server.port)
    await admin.config_set("requirepass", password)
    await admin.aclose()
    url = f"redis://:{password}@127.0.0.1:{redis_server.port}/0"
    interval = sys.getswitchinterval()
    prefill = await start_prefill(TOKEN, redis_url=url)
    decode = await start_decode(TOKEN, [], redis_url=url)  # no static peers: the registry's only
    try:
        view = RedisRegistry(url)
        await view.start()
        try:
            for _ in range(100):
                if any(w.address == prefill.address for w in view.workers("prefill")):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the prefill worker never appeared in the registry")
        finally:
            await view.stop()
        await asyncio.sleep(0.6)  # decode's own view refreshes every 0.25 s
        tokens, local = await generate(decode.address, decode_request("listed", prefill.address))
        assert local == 0 and len(tokens) == 8
        async with listener() as (rogue, connections):
            _, local = await generate(decode.address, decode_request("unlisted", rogue, prompt=OTHER_PROMPT))
            await asyncio.sleep(0.2)
            assert local == len(PROMPT) and connections == []
        anonymous = aioredis.Redis(port=redis_server.port)
        with pytest.raises(Exception, match="(?i)auth"):
            await anonymous.set("tandem:worker:intruder", "{}")
        await anonymous.aclose()
    finally:
        await decode.close()
        await prefill.close()
        sys.setswitchinterval(interval)


# -- a worker beyond loopback refuses to start without authentication ---------------------------------------------
def test_a_worker_beyond_loopback_needs_a_token_or_mutual_tls(tmp_path: Path) -> None:
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("-")  # TlsConfig checks only that the files exist
    mutual = TlsConfig(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "ca.pem"))
    server_only = TlsConfig(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    for role in ("prefill", "decode"):
        for host in ("0.0.0.0", "::", "", "10.0.0.7", "my-host"):
            with pytest.raises(ConfigError, match="TANDEM_INTERNAL_TOKEN.*--insecure"):
                ServiceOptions(role=role, host=host)
            with pytest.raises(ConfigError):
                ServiceOptions(role=role, host=host, tls=server_only)  # authenticates the server only
            ServiceOptions(role=role, host=host, internal_token=TOKEN)
            ServiceOptions(role=role, host=host, tls=mutual)
            ServiceOptions(role=role, host=host, insecure=True)
        for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
            ServiceOptions(role=role, host=host)  # loopback: as before
    ServiceOptions(role="gateway", host="0.0.0.0")  # the public port: clients bring API keys, not the token
    assert is_loopback("127.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("example.com")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_cli_refuses_a_worker_beyond_loopback_without_authentication(role: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV)}
    done = subprocess.run([sys.executable, "-m", "tandem.cli", role, "--model", MODEL, "--host", "0.0.0.0",
                           "--port", "0", "--http-port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "beyond loopback" in done.stderr and "TANDEM_INTERNAL_TOKEN" in done.stderr and "--insecure" in done.stderr
    # A token too weak to use is refused by name, without echoing it.
    done = subprocess.run([sys.executable, "-m", "tandem.cli", role, "--host", "0.0.0.0"], capture_output=True,
                          env=dict(env, **{INTERNAL_TOKEN_ENV: "hunter2"}), text=True, timeout=60)
    assert done.returncode == 2 and "at least 16 characters" in done.stderr and "hunter2" not in done.stderr


# -- where the token comes from -----------------------------------------------------------------------------------
def test_token_sources(tmp_path: Path) -> None:
    assert load_internal_token(env={}) is None
    assert load_internal_token(env={INTERNAL_TOKEN_ENV: f"  {TOKEN}\n"}) == TOKEN
    file = tmp_path / "token"
    file.write_text(TOKEN + "\n")
    assert load_internal_token(file, env={}) == TOKEN
    assert load_internal_token(env={INTERNAL_TOKEN_FILE_ENV: str(file)}) == TOKEN
    for env, match in (({INTERNAL_TOKEN_ENV: TOKEN, INTERNAL_TOKEN_FILE_ENV: str(file)}, "both"),
                       ({INTERNAL_TOKEN_ENV: "short"}, "at least 16"),
                       ({INTERNAL_TOKEN_ENV: "x" * 20 + " y"}, "printable ASCII"),
                       ({INTERNAL_TOKEN_FILE_ENV: str(tmp_path / "missing")}, "cannot read")):
        with pytest.raises(ConfigError, match=match):
            load_internal_token(env=env)
    assert len(generate_token()) == 64 and generate_token() != generate_token()


def test_the_internal_token_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    printed = runner.invoke(app, ["internal-token"])
    assert printed.exit_code == 0 and load_internal_token(env={INTERNAL_TOKEN_ENV: printed.stdout}) is not None
    file = tmp_path / "internal-token"
    assert runner.invoke(app, ["internal-token", "--file", str(file)]).exit_code == 0
    first = load_internal_token(file, env={})
    assert first is not None and first not in runner.invoke(app, ["internal-token", "--file", str(file)]).stdout
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert load_internal_token(file, env={}) == first  # kept across runs (compose restarts)
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    assert runner.invoke(app, ["internal-token", "--file", str(file)]).exit_code == 0
    assert load_internal_token(file, env={}) == TOKEN  # the operator's choice wins


# -- tandem up and compose hand every service the token ----------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in (INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV, "TANDEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def planned(tmp_path: Path, **fields: Any) -> Stack:
    stack = Stack(StackOptions(model=MODEL, log_dir=tmp_path, **fields))
    stack._plan()
    return stack


def test_tandem_up_gives_every_service_one_fresh_token(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    stack = planned(tmp_path)
    tokens = {stack.child_env(s.role)[INTERNAL_TOKEN_ENV] for s in stack.services}
    assert len(tokens) == 1 and len(token := tokens.pop()) == 64
    assert all(token not in " ".join(s.command) for s in stack.services)  # never on a command line (`ps`)
    assert planned(tmp_path).child_env("decode")[INTERNAL_TOKEN_ENV] != token  # one per run
    clean_env.setenv(INTERNAL_TOKEN_ENV, TOKEN)  # one exported by the user (workers added by hand) is kept
    assert planned(tmp_path).child_env("prefill")[INTERNAL_TOKEN_ENV] == TOKEN
    clean_env.delenv(INTERNAL_TOKEN_ENV)
    file = tmp_path / "token"
    file.write_text(TOKEN)
    clean_env.setenv(INTERNAL_TOKEN_FILE_ENV, str(file))
    env = planned(tmp_path).child_env("gateway")
    assert env[INTERNAL_TOKEN_ENV] == TOKEN and INTERNAL_TOKEN_FILE_ENV not in env

    # A Redis password reaches the services in their environment, not on their command lines.
    clean_env.delenv(INTERNAL_TOKEN_FILE_ENV)
    secret_url = "redis://:s3cret-pass@127.0.0.1:6379/0"
    stack = planned(tmp_path, redis_url=secret_url)
    assert all("s3cret-pass" not in " ".join(s.command) for s in stack.services)
    assert stack.child_env("decode")["TANDEM_REDIS_URL"] == secret_url
    for service in stack.services:
        params = _parse(service.command[3:])
        assert params["redis"] is None  # typer reads $TANDEM_REDIS_URL in the child
    plain = planned(tmp_path, redis_url="redis://127.0.0.1:6379/0")
    assert "redis://127.0.0.1:6379/0" in plain.services[0].command
    assert "TANDEM_REDIS_URL" not in plain.child_env("gateway")


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_compose_writes_a_token_every_service_reads(project: str) -> None:
    services = load(*PROJECTS[project])["services"]
    writer = services["internal-token"]
    params = _parse(writer["command"])
    # The operator's $TANDEM_INTERNAL_TOKEN passes through (a key without a value), if set; else the command keeps
    # the token already in the volume, or draws one.
    assert writer["restart"] == "no" and writer["environment"][INTERNAL_TOKEN_ENV] is None
    assert writer["image"] == services["prefill"]["image"]  # the CPU override switches both
    for role in ("prefill", "decode", "gateway"):
        service = services[role]
        assert service["environment"][INTERNAL_TOKEN_FILE_ENV] == str(params["file"])
        assert INTERNAL_TOKEN_ENV not in service["environment"]
        assert service["depends_on"]["internal-token"]["condition"] == "service_completed_successfully"
        assert "models:/models" in service["volumes"] and str(params["file"]).startswith("/models/")


async def test_a_decode_worker_reports_serving_once_its_prefill_peer_answers() -> None:
    """Warm start: a decode worker given a prefill worker that is not up yet listens (its Info answers) but reports
    NOT_SERVING until that worker is up and learnt, then SERVING and ready; a peer that refuses it (another stack's
    token) does not hold it back."""
    from tandem.launcher import free_port

    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    port = free_port("127.0.0.1")
    task = asyncio.ensure_future(decode_server.serve(
        ServiceOptions(role="decode", port=port, http_port=0, drain_s=0.0, internal_token=TOKEN), engine_config(),
        MODEL, prefill_peers=[address], on_started=lambda a, h: ready.set_result(a), stop=stop))
    prefill: Running | None = None
    try:
        async with make_channel(f"127.0.0.1:{port}", internal_token=TOKEN) as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(600):  # the engine builds, then the server listens
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await worker_pb2_grpc.DecodeStub(channel).Info(worker_pb2.InfoRequest(), timeout=1.0)
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("decode never listened")
            assert not ready.done()
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            prefill = await start(lambda on_started, stop_prefill: prefill_server.serve(
                ServiceOptions(role="prefill", port=int(address.rsplit(":", 1)[1]), http_port=0, drain_s=0.0,
                               internal_token=TOKEN), engine_config(), MODEL, on_started=on_started, stop=stop_prefill))
            await asyncio.wait_for(ready, 5.0)
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        if prefill is not None:
            await prefill.close()
    # Refused by its peer: ready at once, not after WARM_PEERS_MAX_S.
    other = await start_prefill(generate_token())
    try:
        decode = await asyncio.wait_for(start_decode(TOKEN, [other.address]), 20.0)
        await decode.close()
    finally:
        await other.close()


async def test_a_decode_worker_stopped_while_it_warms_up_drains_without_ever_reporting_ready() -> None:
    """A stop while decode waits for a prefill worker that never comes up ends the service at once (not after
    WARM_PEERS_MAX_S): it never turns SERVING and never says it is ready."""
    from tandem.launcher import free_port

    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    port = free_port("127.0.0.1")
    task = asyncio.ensure_future(decode_server.serve(
        ServiceOptions(role="decode", port=port, http_port=0, drain_s=0.0, internal_token=TOKEN), engine_config(),
        MODEL, prefill_peers=[f"127.0.0.1:{free_port('127.0.0.1')}"], on_started=lambda a, h: ready.set_result(a),
        stop=stop))
    try:
        async with make_channel(f"127.0.0.1:{port}", internal_token=TOKEN) as channel:
            for _ in range(600):  # the engine builds, then the server listens NOT_SERVING
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                            timeout=1.0)
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("decode never listened")
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        stop.set()
        await asyncio.wait_for(task, 10.0)  # WARM_PEERS_MAX_S is 60
    assert not ready.done()

"""One trace per request across gateway, prefill and decode, collected by a real OTLP receiver.

The three services run in this process over real gRPC on loopback, each with its own tracer provider
(the global one can be set only once per process) exporting over OTLP/gRPC, configured from the same
variables a deployment sets, to the receiver. The trace context crosses the services exactly as between
processes: as `traceparent` metadata.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.decode_svc.server import create_servicer
from tandem.decode_svc.servicer import DecodeServicer
from tandem.engine.engine import Engine
from tandem.gateway.router import Router
from tandem.gateway.server import load_gateway_model
from tandem.gateway.servicer import GenerationServicer
from tandem.models import load_model_config
from tandem.prefill_svc.servicer import PrefillServicer
from tandem.prefill_svc.servicer import add_to_server as add_prefill_to_server
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.registry import StaticRegistry
from tandem.serving.rpc import make_channel, start_server
from tandem.serving.telemetry import SERVICE_NAMES, TRACER_NAMES, exporter_from_env, make_tracer_provider
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2_grpc
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

MODEL = "dummy:tiny"  # random weights; SmolLM2's tokenizer for the text


@dataclass
class Stack:
    gateway: str
    receiver: OtlpReceiver
    providers: list[TracerProvider]

    def flush(self) -> None:
        for provider in self.providers:
            provider.force_flush()


def provider_for(role: str, receiver: OtlpReceiver) -> TracerProvider:
    exporter = exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
    assert exporter is not None
    return make_tracer_provider(SERVICE_NAMES[role], exporter)


async def start_stack(receiver: OtlpReceiver, prefill_address: str | None) -> tuple[Stack, list[object]]:
    """Decode (and prefill, unless `prefill_address` names one) workers and a gateway; what to stop after."""
    providers = {role: provider_for(role, receiver) for role in SERVICE_NAMES}
    config = EngineConfig(model=load_model_config(MODEL), cache=CacheConfig(block_size=16, num_blocks=64),
                          scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=512))
    owned: list[object] = []
    addresses: dict[str, str] = {}
    for role in ("prefill", "decode"):
        if role == "prefill" and prefill_address is not None:
            addresses[role] = prefill_address
            continue
        engine = AsyncEngine(Engine(config), name=f"trace-{role}")
        tracer = providers[role].get_tracer(TRACER_NAMES[role])
        servicer: PrefillServicer | DecodeServicer
        if role == "prefill":
            servicer = PrefillServicer(engine, MODEL, tracer=tracer)
            add, name = add_prefill_to_server, "tandem.v1.Prefill"
        else:
            servicer = create_servicer(engine, MODEL, tracer=tracer)
            add, name = worker_pb2_grpc.add_DecodeServicer_to_server, "tandem.v1.Decode"

        def register(server: grpc.aio.Server, servicer: object = servicer, add: object = add,
                     name: str = name) -> list[str]:
            add(servicer, server)  # type: ignore[operator]
            return [name]

        server, port, _ = await start_server("127.0.0.1:0", register)
        addresses[role] = f"127.0.0.1:{port}"
        owned += [server, engine]
    # No probe: every address counts as up, so a dead prefill worker is still chosen (and fails).
    registry = StaticRegistry([addresses["prefill"]], [addresses["decode"]])
    await registry.start()
    router = Router(load_gateway_model(MODEL, 256), registry,
                    tracer=providers["gateway"].get_tracer(TRACER_NAMES["gateway"]))

    def register_gateway(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
        return ["tandem.v1.Generation"]

    server, port, _ = await start_server("127.0.0.1:0", register_gateway)
    owned += [server, registry, router]
    return Stack(f"127.0.0.1:{port}", receiver, list(providers.values())), owned


async def stop_all(owned: list[object], providers: list[TracerProvider]) -> None:
    for thing in owned:
        if isinstance(thing, grpc.aio.Server):
            await thing.stop(0)
        elif isinstance(thing, AsyncEngine):
            thing.close()
        elif isinstance(thing, StaticRegistry):
            await thing.stop()
        elif isinstance(thing, Router):
            await thing.close()
    for provider in providers:
        # In a thread: the last export goes to the receiver, which this event loop serves.
        await asyncio.to_thread(provider.shutdown)


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = await OtlpReceiver.start()
    yield receiver
    await receiver.stop()


async def generate(gateway: str, request_id: str, prompt: str,
                   max_tokens: int = 6) -> list[generation_pb2.GenerateResponse]:
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt=prompt, request_id=request_id, sampling=sampling)
    async with make_channel(gateway) as channel:
        return [r async for r in generation_pb2_grpc.GenerationStub(channel).Generate(request)]


def trace_of(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    """The spans of the trace whose `generate` span carries `request_id`."""
    root = next(s for s in spans if s.name == "generate" and s.attributes.get("tandem.request_id") == request_id)
    return [s for s in spans if s.trace_id == root.trace_id]


def has_spans(request_id: str, names: set[str]) -> object:
    def done(spans: list[ReceivedSpan]) -> bool:
        roots = [s for s in spans if s.name == "generate" and s.attributes.get("tandem.request_id") == request_id]
        return bool(roots) and names <= {s.name for s in spans if s.trace_id == roots[0].trace_id}
    return done


async def test_one_trace_covers_gateway_prefill_and_decode(smollm2_path: Path, receiver: OtlpReceiver) -> None:
    stack, owned = await start_stack(receiver, prefill_address=None)
    try:
        responses = await generate(stack.gateway, "r1", "The capital of France is")
        assert sum(len(r.token_ids) for r in responses) == 6
        names = {"generate", "tokenize", "route", "stream", "decode.generate", "decode.admission", "kv.transfer",
                 "prefill", "decode"}
        spans = await receiver.wait_for(has_spans("r1", names), stack.flush)
    finally:
        await stop_all(owned, stack.providers)
    trace = {span.name: span for span in trace_of(spans, "r1")}
    assert sorted(trace) == sorted(span.name for span in trace_of(spans, "r1")) == sorted(names)
    services = {name: span.service for name, span in trace.items()}
    assert services["generate"] == services["route"] == services["stream"] == "tandem-gateway"
    assert services["decode.generate"] == services["kv.transfer"] == services["decode"] == "tandem-decode"
    assert services["prefill"] == "tandem-prefill"

    # Parent/child links, across the three processes' worth of services.
    parent_of = {"tokenize": "generate", "route": "generate", "stream": "generate",
                 "decode.generate": "stream", "decode.admission": "decode.generate",
                 "kv.transfer": "decode.generate", "prefill": "kv.transfer", "decode": "decode.generate"}
    for child, parent in parent_of.items():
        assert trace[child].parent_span_id == trace[parent].span_id, f"{child} is not a child of {parent}"
    assert trace["generate"].parent_span_id == ""

    kv = trace["kv.transfer"].attributes
    assert kv["tandem.kv.transport"] == "grpc"
    assert kv["tandem.kv.bytes"] > 0 and kv["tandem.kv.layers"] == 2 and kv["tandem.kv.gb_per_s"] > 0
    assert trace["prefill"].attributes["tandem.kv.bytes"] == kv["tandem.kv.bytes"]
    assert trace["prefill"].attributes["tandem.batch_size"] >= 1
    assert trace["prefill"].attributes["tandem.compute_s"] > 0
    assert trace["decode"].attributes["tandem.completion_tokens"] == 6
    assert trace["decode"].attributes["tandem.decode.steps"] == 5  # the first token came from prefill
    assert trace["stream"].attributes["tandem.finish_reason"] == "length"
    assert trace["route"].attributes["tandem.route.prefill"] != ""
    assert "queued" in trace["decode.admission"].event_names  # on the engine's queue, then its blocks reserved
    assert not any(span.is_error for span in trace.values())

    # The batched forward is a span of its own, linked to the request's prefill span (and back).
    prefill = trace["prefill"]
    batches = [s for s in spans if s.name == "prefill.batch" and (prefill.trace_id, prefill.span_id) in s.links]
    assert len(batches) == 1 and batches[0].trace_id != prefill.trace_id
    assert (batches[0].trace_id, batches[0].span_id) in prefill.links


async def test_failed_transfer_is_recorded_and_decode_prefills_locally(smollm2_path: Path,
                                                                       receiver: OtlpReceiver) -> None:
    stack, owned = await start_stack(receiver, prefill_address="127.0.0.1:1")  # nobody listens there
    try:
        await generate(stack.gateway, "r2", "Nobody prefills this")
        names = {"generate", "decode.generate", "kv.transfer", "decode.admission", "prefill.local", "decode"}
        spans = await receiver.wait_for(has_spans("r2", names), stack.flush)
    finally:
        await stop_all(owned, stack.providers)
    in_trace = trace_of(spans, "r2")
    trace = {span.name: span for span in in_trace}
    assert trace["kv.transfer"].is_error and "exception" in trace["kv.transfer"].event_names
    assert not trace["decode.generate"].is_error  # the request itself was served
    assert trace["prefill.local"].attributes["tandem.prompt_tokens"] > 0
    # Two admissions: waiting for blocks to pull into, then the engine's queue for the local prefill.
    assert [s.name for s in in_trace].count("decode.admission") == 2

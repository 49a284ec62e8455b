"""`tandem decode`: one decode worker process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence

import grpc
from opentelemetry import trace

from tandem.common.config import EngineConfig, env_number
from tandem.decode_svc.generation import RequestRunner
from tandem.decode_svc.kv_pull import KVPuller
from tandem.decode_svc.servicer import DecodeServicer
from tandem.decode_svc.tracing import DecodeTraces
from tandem.engine.engine import StepResult
from tandem.engine.spec_decode import SpeculativeConfig
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.registry import RedisRegistry
from tandem.serving.rpc import ChannelPool, TlsConfig
from tandem.serving.service import ServiceOptions, run_service
from tandem.serving.telemetry import get_tracer
from tandem.serving.worker import new_worker_id, start_engine, worker_record
from tandem.v1 import worker_pb2_grpc

# How long a decode worker waits at start-up for its configured prefill workers (`--prefill`) to answer before it
# reports SERVING without them: a prefill worker that maps this worker's weights came up ~14 s after it in the GPU stack
# test (H100).
WARM_PEERS_MAX_S = 60.0


def create_servicer(engine: AsyncEngine, model_name: str, *, kv_transport: str = "auto", max_queued: int = 1024,
                    tls: TlsConfig | None = None, tracer: trace.Tracer | None = None,
                    is_known_peer: Callable[[str], Awaitable[bool]] | None = None,
                    internal_token: str | None = None) -> DecodeServicer:
    """The decode service's parts, wired: the KV puller (its channels use `tls`, this worker's certificate, for
    mutual TLS to prefill workers, and carry the stack's `internal_token`; it dials only peers `is_known_peer`
    accepts, any if None: `serve` always gives it), the request runner, the servicer. `tracer`: the process-wide
    one unless given (tests host several services in one process)."""
    traces = DecodeTraces(tracer or get_tracer("decode"))
    puller = KVPuller(engine, ChannelPool(tls, internal_token), traces, kv_transport, is_known_peer)
    return DecodeServicer(engine, model_name, RequestRunner(engine, puller, traces, max_queued))


class PrefillPeers:
    """The prefill workers this decode worker may dial: the configured addresses, and those the registry lists
    (never an address taken from a request alone)."""

    def __init__(self, addresses: Sequence[str], registry: RedisRegistry | None) -> None:
        self.addresses = frozenset(addresses)
        self.registry = registry

    async def is_known(self, address: str) -> bool:
        if address in self.addresses:
            return True
        return self.registry is not None and any(w.address == address for w in self.registry.workers("prefill"))


async def serve(service: ServiceOptions, config: EngineConfig, model_name: str, kv_transport: str = "auto",
                max_queued: int = 1024, prefill_peers: Sequence[str] = (),
                speculative: SpeculativeConfig | None = None,
                on_started: Callable[[str, int], None] | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM (or `stop`, for a worker run inside a test), pulling prompts' pages only from the
    prefill workers in `prefill_peers` or in the registry, with the stack's internal token when it has one."""
    # The engine thread shares the GIL with the event loop, whose work per step (a batch's tokens into session
    # messages) runs in long Python stretches: a shorter switch interval might let the engine thread launch the next
    # step sooner. An experiment's knob: on an H200 0.5 ms against Python's 5 ms made no difference beyond the
    # run-to-run spread (benchmarks/results/h200-2026-12-02d/, three runs each).
    if (interval := env_number("TANDEM_DECODE_SWITCH_INTERVAL_S", 0.0)):
        sys.setswitchinterval(interval)
    engine = start_engine(config, "decode", speculative)
    registry = RedisRegistry(service.redis_url) if service.redis_url else None
    if registry is not None:
        await registry.start()
    peers = PrefillPeers(prefill_peers, registry)

    def on_step(result: StepResult, seconds: float) -> None:
        if result.requests:  # a step that found nothing to run (all waiting for pages) is no batch
            metrics.BATCH_SIZE.observe(len(result.requests))
        if result.num_draft_tokens:
            metrics.SPEC_DRAFT_TOKENS.inc(result.num_draft_tokens)
            metrics.SPEC_ACCEPTED_TOKENS.inc(result.num_accepted_tokens)
        if result.num_draft_prompt_tokens:
            metrics.SPEC_DRAFT_PROMPT_TOKENS.inc(result.num_draft_prompt_tokens)

    engine.on_step = on_step
    servicer = create_servicer(engine, model_name, kv_transport=kv_transport, max_queued=max_queued, tls=service.tls,
                               is_known_peer=peers.is_known, internal_token=service.internal_token)
    worker_id = new_worker_id("decode")
    # Warm start: learn the configured prefill workers and have them map this worker's pool now, before this worker
    # reports SERVING (it listens meanwhile: a prefill worker that maps its weights needs it), so that a first request
    # pays for neither. A peer that is not up within WARM_PEERS_MAX_S is learnt later, by the first request to it.
    connecting = [asyncio.create_task(servicer.runner.puller.connect(address)) for address in prefill_peers]

    async def warm_up() -> None:
        if connecting:
            await asyncio.wait(connecting, timeout=WARM_PEERS_MAX_S)

    def add(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        return ["tandem.v1.Decode"]

    async def cleanup() -> None:
        for task in connecting:
            task.cancel()
        if registry is not None:
            await registry.stop()
        await servicer.close()
        engine.close()

    await run_service(service, add, lambda address: worker_record(engine, "decode", model_name, worker_id, address),
                      cleanup=cleanup, on_drain=servicer.drain, on_started=on_started, stop=stop, warm_up=warm_up)

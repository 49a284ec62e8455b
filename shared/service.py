"""What every service process shares: options, engine construction, registry, metrics, drain.

The services themselves (prefill_svc, decode_svc, gateway) stay thin: convert, call, convert back.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from tandem.shared import metrics
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from tandem.shared.kv_ipc import gpu_uuid, transports_of
from tandem.shared.kv_transfer import layout_to_proto
from tandem.shared.registry import RedisRegistry, WorkerRecord
from tandem.shared.rpc import AddServicers, TlsConfig, start_server, stop_server
from tandem.shared.telemetry import SERVICE_NAMES, setup_tracing
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceOptions:
    """Network side of a service: where it binds, what it advertises, where its metrics are."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    # Address other processes reach this one at (it may differ from the bind address, e.g. in
    # containers); default: host:port as bound (0.0.0.0 replaced by this machine's hostname).
    advertise: str | None = None
    http_port: int = 0
    redis_url: str | None = None
    drain_s: float = 30.0
    max_concurrent_streams: int = 256
    # TLS on the gRPC port and on this service's calls to others; None: plaintext (the loopback default).
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if self.role not in ("gateway", "prefill", "decode"):
            raise ConfigError(f"role must be gateway, prefill or decode, got {self.role!r}")
        if not 0 <= self.port < 65536 or not 0 <= self.http_port < 65536:
            raise ConfigError(f"port: out of range ({self.port}, {self.http_port})")

    def advertised(self, bound_port: int) -> str:
        if self.advertise:
            return self.advertise
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{bound_port}"


@dataclass(frozen=True)
class EngineOptions:
    """Engine flags shared by the prefill and decode commands."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_fraction: float = 0.85
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    use_triton: bool = True
    use_cuda_graphs: bool = True


def build_engine_config(options: EngineOptions) -> EngineConfig:
    from tandem.shared.models import load_model_config

    return EngineConfig(
        model=load_model_config(options.model),
        cache=CacheConfig(block_size=options.block_size, num_blocks=options.num_kv_blocks,
                          gpu_memory_fraction=options.gpu_memory_fraction),
        scheduler=SchedulerConfig(max_num_seqs=options.max_num_seqs,
                                  max_num_batched_tokens=options.max_num_batched_tokens,
                                  max_model_len=options.max_model_len),
        device=options.device, dtype=options.dtype, use_triton=options.use_triton,
        use_cuda_graphs=options.use_cuda_graphs,
    )


async def run_service(options: ServiceOptions, add_servicers: AddServicers,
                      record: Callable[[str], WorkerRecord] | None = None,
                      on_started: Callable[[str, int], None] | None = None,
                      cleanup: Callable[[], Awaitable[None]] | None = None,
                      start_http: Callable[[str, int], Awaitable[int]] | None = None,
                      interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                      on_drain: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: NOT_SERVING at once, deregister, let calls in flight
    finish for up to `drain_s`, stop. `record(address)` describes this worker for the registry.
    `start_http(host, port)` starts the service's own HTTP server (which must serve `/metrics`) in place
    of the metrics-only one and returns its bound port; `cleanup` stops it. `interceptors` (e.g. the
    gateway's API keys) wrap every handler. `on_drain` runs as the drain begins (a decode worker ends its
    long-lived sessions as their requests finish)."""
    # Tracing (off unless OTEL_* asks for it) is set up first: the servicers' tracers are proxies that
    # record from then on. Replicas share a service.name; the instance id tells them apart.
    tracer_provider = setup_tracing(SERVICE_NAMES[options.role], instance_id=options.advertised(options.port))
    server, port, health = await start_server(f"{options.host}:{options.port}", add_servicers, tls=options.tls,
                                              max_concurrent_streams=options.max_concurrent_streams,
                                              interceptors=interceptors)
    if start_http is not None:
        http_port = await start_http(options.host, options.http_port)
    else:
        http_port = metrics.serve_metrics(options.http_port, options.host)
    address = options.advertised(port)
    registry: RedisRegistry | None = None
    if options.redis_url and record is not None:
        registry = RedisRegistry(options.redis_url)
        await registry.register(lambda: record(address))
    # The launcher (`tandem up`) and people read this line to find the service.
    print(f"tandem {options.role} ready grpc={options.host}:{port} advertise={address} "
          f"http=http://{options.host}:{http_port}", flush=True)
    if on_started is not None:
        on_started(address, http_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s draining (up to %.0f s)", options.role, options.drain_s)
    # NOT_SERVING first: gateways probing health stop routing here even before Redis hears of it.
    await health.enter_graceful_shutdown()
    if on_drain is not None:
        on_drain()
    if registry is not None:
        await registry.deregister()
        await registry.stop()
    await stop_server(server, health, options.drain_s)
    if cleanup is not None:
        await cleanup()
    if tracer_provider is not None:
        tracer_provider.shutdown()  # exports the spans still queued


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def is_unreachable(error: grpc.aio.AioRpcError) -> bool:
    """Errors after which another worker (or a local fallback) may succeed."""
    return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED)


def worker_info(async_engine: AsyncEngine, role: str, model_name: str) -> worker_pb2.WorkerInfo:
    """The `Info` answer of a prefill or decode worker (read between steps; counts may lag by one)."""
    engine = async_engine.engine
    return worker_pb2.WorkerInfo(
        role=role, model=model_name, layout=layout_to_proto(engine.layout),
        num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
        queue_depth=engine.scheduler.num_queued, num_running=len(engine.scheduler.running),
        max_model_len=engine.max_model_len, vocab_size=engine.config.model.vocab_size,
        gpu_uuid=gpu_uuid(engine.runner.device), kv_transports=transports_of(engine.runner.device))


def worker_record(async_engine: AsyncEngine, role: str, model_name: str, worker_id: str,
                  address: str) -> WorkerRecord:
    """What this worker advertises in the registry."""
    engine = async_engine.engine
    return WorkerRecord(role=role, address=address, model=model_name, fingerprint=engine.layout.fingerprint(),
                        num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
                        queue_depth=engine.scheduler.num_queued, worker_id=worker_id, updated_at=time.time())

"""What every service process shares: where it listens, tracing, `/metrics`, Redis registration, drain on
SIGTERM. No torch here: the gateway runs on it too (the workers' engine side is `tandem.serving.worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from tandem.common.config import ConfigError, env_number
from tandem.serving import metrics
from tandem.serving.auth import InternalTokenInterceptor, require_auth_beyond_loopback, validate_token
from tandem.serving.registry import RedisRegistry, WorkerRecord
from tandem.serving.rpc import (
    DEFAULT_MAX_MESSAGE_BYTES,
    AddServicers,
    TlsConfig,
    set_serving,
    start_server,
    stop_server,
)
from tandem.serving.telemetry import SERVICE_NAMES, setup_tracing

log = logging.getLogger(__name__)

# A decode worker sends an empty message on a `Decode.Session` that has requests in flight whenever it has sent
# nothing for this long, so that the gateway can tell a worker that is waiting (a long prefill, say) from one
# that is frozen (stopped, or its event loop stuck): see `GatewayLimits.decode_stall_timeout_s`.
SESSION_HEARTBEAT_S = 0.5
# A gateway that opens a `Decode.Session` with this metadata (a count of messages) acknowledges each message it reads
# (`SessionAck`), and the worker keeps at most that many unacknowledged; at most MAX_SESSION_WINDOW is taken.
SESSION_WINDOW_KEY = "x-tandem-session-window"
MAX_SESSION_WINDOW = 64


def session_window(metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """The window a gateway asked for in its session's metadata; 0 (none: send as fast as the transport takes it)
    when it asked for none or for something that is not a count."""
    for key, value in metadata or ():
        if key == SESSION_WINDOW_KEY:
            try:
                window = int(value)
            except ValueError:
                return 0
            return min(max(window, 0), MAX_SESSION_WINDOW)
    return 0


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
    # Streams one client connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
    max_concurrent_streams: int = 256
    # Largest gRPC message received or sent (gRPC answers RESOURCE_EXHAUSTED past it).
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # TLS on the gRPC port and on this service's calls to others; None: plaintext (the loopback default).
    tls: TlsConfig | None = None
    # The stack's shared secret (`tandem.serving.auth`): a worker requires it on every call (but health checks and
    # reflection), and every service sends it on its calls to workers. None: no token (loopback, or mutual TLS).
    internal_token: str | None = field(default=None, repr=False)
    # A worker beyond loopback with neither a token nor mutual TLS refuses to start unless this is set.
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.role not in ("gateway", "prefill", "decode"):
            raise ConfigError(f"role must be gateway, prefill or decode, got {self.role!r}")
        if not 0 <= self.port < 65536 or not 0 <= self.http_port < 65536:
            raise ConfigError(f"port: out of range ({self.port}, {self.http_port})")
        if self.max_concurrent_streams < 1 or self.max_message_bytes < 1:
            raise ConfigError(f"max_concurrent_streams and max_message_bytes must be at least 1, got "
                              f"{self.max_concurrent_streams}, {self.max_message_bytes}")
        if self.internal_token is not None:
            validate_token(self.internal_token, "internal_token")
        if self.role != "gateway":  # the gateway's port is public: its clients bring API keys, not this token
            require_auth_beyond_loopback(self.role, self.host, self.internal_token, self.mutual_tls, self.insecure)

    @property
    def mutual_tls(self) -> bool:
        """Whether this service's port requires client certificates signed by the stack's CA."""
        return self.tls is not None and self.tls.ca_file is not None and self.tls.client_auth

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """What guards this service's port for the stack: a worker with a token requires it on every call."""
        if self.role == "gateway" or self.internal_token is None:
            return []
        return [InternalTokenInterceptor(self.internal_token)]

    def describe_auth(self) -> str:
        parts = ["internal token" if self.internal_token else "", "mutual TLS" if self.mutual_tls else ""]
        described = " + ".join(p for p in parts if p)
        if described:
            return described
        return "none (--insecure)" if self.insecure else "none (loopback only)"

    def advertised(self, bound_port: int) -> str:
        if self.advertise:
            return self.advertise
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{bound_port}"


# The garbage collector's youngest-generation threshold while serving, from TANDEM_GC_YOUNG_THRESHOLD (unset or 0:
# Python's own, 700 allocations). A serving loop allocates short-lived objects per token (messages, futures,
# lists); with a threshold set, what start-up built moves to the collector's permanent generation and young
# collections run less often. Measured with the gateway alone (`stack_overhead --fake-decode-step-ms 1`), 50,000
# against Python's: -14% CPU per token on the 2-core CPU VM (Python 3.11), no difference on the H200 host (Python
# 3.12; nor on the stack's share of the engine), so it is off by default: benchmarks/results/README.md, "Garbage
# collection while serving".


def settle_heap() -> None:
    """Once start-up is done, with TANDEM_GC_YOUNG_THRESHOLD set: what start-up built (modules, the model, the
    tokenizer's tables) is never scanned again and young collections wait for that many allocations."""
    threshold = int(env_number("TANDEM_GC_YOUNG_THRESHOLD", 0, int))
    if threshold == 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(threshold, middle, old)


async def _until_stopped(work: Awaitable[object], stop: asyncio.Event) -> bool:
    """Run `work` unless `stop` is set first (then cancel it): True when it finished."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # its exception, if any
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def run_service(options: ServiceOptions, add_servicers: AddServicers,
                      record: Callable[[str], WorkerRecord] | None = None,
                      on_started: Callable[[str, int], None] | None = None,
                      cleanup: Callable[[], Awaitable[None]] | None = None,
                      start_http: Callable[[str, int], Awaitable[int]] | None = None,
                      interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                      on_drain: Callable[[], None] | None = None,
                      stop: asyncio.Event | None = None,
                      warm_up: Callable[[], Awaitable[object]] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: NOT_SERVING at once, deregister, let calls in flight
    finish for up to `drain_s`, stop. `record(address)` describes this worker for the registry.
    `start_http(host, port)` starts the service's own HTTP server (which must serve `/metrics`) in place
    of the metrics-only one and returns its bound port; `cleanup` stops it. `interceptors` (e.g. the
    gateway's API keys) wrap every handler. `on_drain` runs as the drain begins (a decode worker ends its
    long-lived sessions as their requests finish; the gateway refuses new HTTP requests). With `stop`, the
    drain begins when it is set and no signal handler is installed (a service run inside a test). With `warm_up`
    the server listens NOT_SERVING while it runs (its peers may call it meanwhile: a prefill worker mapping a decode
    worker's weights does), then turns SERVING, registers and says it is ready."""
    # Tracing (off unless OTEL_* asks for it) is set up first: the servicers' tracers are proxies that
    # record from then on. Replicas share a service.name; the instance id tells them apart.
    tracer_provider = setup_tracing(SERVICE_NAMES[options.role], instance_id=options.advertised(options.port))
    # The internal token first: a call without it is refused before any other interceptor looks at it.
    service_names: list[str] = []

    def add(server: grpc.aio.Server) -> list[str]:
        service_names.extend(add_servicers(server))
        return service_names

    server, port, health = await start_server(f"{options.host}:{options.port}", add, tls=options.tls,
                                              max_concurrent_streams=options.max_concurrent_streams,
                                              max_message_bytes=options.max_message_bytes,
                                              interceptors=[*options.server_interceptors(), *interceptors],
                                              serving=warm_up is None)
    if options.role != "gateway":
        log.info("%s: service-to-service authentication: %s", options.role, options.describe_auth())
    if start_http is not None:
        http_port = await start_http(options.host, options.http_port)
    else:
        http_port = metrics.serve_metrics(options.http_port, options.host)
    address = options.advertised(port)
    is_own_process = stop is None  # not a service inside a test's process
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    registry: RedisRegistry | None = None
    # A stop during warm-up (its peers may take up to a minute) drains at once: never SERVING, never registered.
    if warm_up is None or await _until_stopped(warm_up(), stop):
        if warm_up is not None:
            await set_serving(health, service_names, True)
        if options.redis_url and record is not None:
            registry = RedisRegistry(options.redis_url)
            await registry.register(lambda: record(address))
        if is_own_process:
            settle_heap()
        # The launcher (`tandem up`) and people read this line to find the service.
        print(f"tandem {options.role} ready grpc={options.host}:{port} advertise={address} "
              f"http=http://{options.host}:{http_port}", flush=True)
        if on_started is not None:
            on_started(address, http_port)
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


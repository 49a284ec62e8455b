"""`tandem up`: the whole stack on one machine, each service its own `tandem <role>` process.

The processes are started with exactly the commands compose runs; the launcher only picks ports,
waits for every service to report SERVING over grpc.health.v1, prints where each one is, and stops
them all on Ctrl-C or SIGTERM. A worker that dies is reported, and the others keep serving.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.config import SHARED_GPU_PREFILL_BATCHED_TOKENS, ConfigError
from tandem.common.paths import tandem_home
from tandem.gateway.limits import DEFAULT_MAX_STREAM_INTERVAL
from tandem.gateway.workers import default_num_workers
from tandem.mps import CONTROL as MPS_CONTROL
from tandem.mps import GpuSplit, MpsDaemon
from tandem.serving.auth import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV, generate_token, load_internal_token
from tandem.serving.rpc import TlsConfig

# Of the GPU's memory, what the workers sharing one GPU take together (each its own share of it).
GPU_MEMORY_FRACTION_SHARED = 0.85
# A prefill worker's KV pool, in steps of its token budget: room for a batch of prompts in flight and a prefix cache
# (decode workers hold the requests' pages while they decode: they get the rest of the GPU).
PREFILL_POOL_STEPS = 8
# Its activations, CUDA graphs and the allocator's slack beside weights and pool.
PREFILL_WORKSPACE_BYTES = 6 << 30


def weight_bytes_estimate(model: Any, quantization: str | None) -> int:
    """The bytes of a Llama-family model's weights from its config: the projections in 2 bytes (1 when quantized to
    int8 or fp8, which leave the embeddings and the output head in 2), norms left out."""
    hidden, inter = model.hidden_size, model.intermediate_size
    attn_out = model.num_attention_heads * model.head_dim
    kv = model.num_key_value_heads * model.head_dim
    per_layer = hidden * (attn_out + 2 * kv) + attn_out * hidden + 3 * hidden * inter
    embed = model.vocab_size * hidden * (1 if model.tie_word_embeddings else 2)
    return per_layer * model.num_hidden_layers * (1 if quantization else 2) + embed * 2


def gpu_memory_shares(model: Any, total_bytes: int, num_prefill: int, num_decode: int, prefill_batched_tokens: int,
                      kv_bytes_per_token: int, quantization: str | None = None,
                      budget: float = GPU_MEMORY_FRACTION_SHARED, shared_weights: bool = False) -> tuple[float, float]:
    """(each prefill worker's, each decode worker's) fraction of one GPU's memory when they share it. A prefill
    worker needs its weights (none with `shared_weights`: it maps a decode worker's), a pool of `PREFILL_POOL_STEPS`
    steps and a workspace; an even split left decode's pool too small for the requests at high load when two prefill
    workers shared an H200 with it (llama-3.1-8b: ~125 requests of 1,280 tokens, against 128 running), so the decode
    workers get the rest of `budget` (the fraction of the GPU all of them take together)."""
    equal = budget / max(1, num_prefill + num_decode)
    if not num_prefill or not num_decode or total_bytes <= 0:
        return round(equal, 3), round(equal, 3)
    weights = 0 if shared_weights else weight_bytes_estimate(model, quantization)
    need = weights + PREFILL_POOL_STEPS * prefill_batched_tokens * kv_bytes_per_token + PREFILL_WORKSPACE_BYTES
    prefill = min(equal, need / total_bytes)  # never more than an even share: decode never gets less than one
    decode = (budget - num_prefill * prefill) / num_decode
    return round(prefill, 3), round(decode, 3)


def gpu_total_bytes() -> int:
    """The smallest GPU's memory on this host from `nvidia-smi` (the launcher itself never opens CUDA: under MPS it
    would become a client); 0 when it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return min(int(line) for line in out.split()) << 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


# A Redis URL with a password reaches the services in the environment, not on their command lines (which `ps`
# shows every user of the machine).
REDIS_URL_ENV = "TANDEM_REDIS_URL"


@dataclass(frozen=True)
class StackOptions:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    redis_url: str | None = None
    device: str = "cpu"
    threads: int = 1
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    gateway_http_port: int = 8000
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    status_file: Path | None = None
    log_dir: Path | None = None
    startup_timeout_s: float = 600.0
    kv_transport: str = "auto"
    gpu_memory_fraction: float | None = None
    # Without gpu_memory_fraction: the fraction of one GPU its workers share (`gpu_memory_shares`' budget); less
    # leaves room for another process on the GPU (the offline engine `benchmarks/stack_overhead.py` runs beside it).
    gpu_memory_budget: float = GPU_MEMORY_FRACTION_SHARED
    max_num_seqs: int = 256
    # The workers' SM caps under CUDA MPS (`tandem.mps.GpuSplit`). None: with `auto_mps`, MPS without partitioning
    # (100:100) when prefill and decode workers share a GPU and MPS is installed, else plain time-sharing.
    gpu_split: GpuSplit | None = None
    auto_mps: bool = True
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    prompt_tokens_while_decoding: int | None = None
    enable_prefix_caching: bool = True
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # Workers' --async-scheduling / --no-async-scheduling; None: their default (on for CUDA).
    async_scheduling: bool | None = None
    # Decode workers' --speculative-config (JSON), or None.
    speculative_config: str | None = None
    # The gateway's --max-request-bytes and --decode-stall-timeout; None: the gateway's defaults.
    max_request_bytes: int | None = None
    decode_stall_timeout_s: float | None = None
    # The gateway's --stream-interval (tokens per streamed message after the first).
    stream_interval: int = 1
    # The gateway's --max-stream-interval (the most it goes to while saturated; 1: off).
    max_stream_interval: int = DEFAULT_MAX_STREAM_INTERVAL
    # The gateway's --local-prefill-max-tokens (prompts this short are prefilled on decode; 0: never).
    local_prefill_max_tokens: int = 0
    # Gateway processes on the gateway's ports (`tandem gateway --workers`); None: one per 4 CPUs, between 1 and 4
    # (`tandem.gateway.workers.default_num_workers`).
    gateway_workers: int | None = None
    # On one GPU, prefill workers map the first decode worker's weights (`tandem prefill --weights-from`) instead of
    # loading a copy each (`tandem.serving.weight_ipc`); measured on an H100 (docs/architecture.md). None: where it
    # costs nothing else (`shares_weights`); True / False: as asked.
    share_weights: bool | None = None

    @property
    def shares_weights(self) -> bool:
        """Whether this stack's prefill workers map a decode worker's weights: on CUDA, both roles present, and each
        worker's memory from `gpu_memory_shares` (a fraction given for every worker assumes its own weights). By
        default (`share_weights` None) also only with one decode worker (a prefill worker on a decode worker's
        weights stops when that worker does: with several, one crash would take every prefill worker with it) and
        without expandable segments (`PYTORCH_CUDA_ALLOC_CONF`: their handles cannot be opened by a peer)."""
        possible = (self.device.startswith("cuda") and self.num_prefill > 0 and self.num_decode > 0
                    and not self.gpu_memory_fraction)
        if self.share_weights is None:
            return (possible and self.num_decode == 1
                    and "expandable_segments:true" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
                    .replace(" ", ""))
        return possible and self.share_weights


@dataclass
class Service:
    role: str
    grpc: str
    http: str
    command: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    reported_exit: bool = field(default=False)

    def as_json(self) -> dict[str, object]:
        assert self.process is not None
        return {"role": self.role, "pid": self.process.pid, "grpc": self.grpc, "http": self.http,
                "log": str(self.log_path)}


# Where `free_port` looks: from here up to the kernel's ephemeral range.
LOWEST_PORT = 10000
_picked: set[int] = set()  # this process's picks: never handed out twice


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports from (Linux; elsewhere its default)."""
    try:
        low, high = (int(p) for p in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str) -> int:
    """A port nothing uses now, for a service started later. Picked below the ephemeral range: a port the kernel
    picks itself (bind to 0) comes from that range, which outgoing connections draw on too, and one of them (the
    launcher's own health checks of the services started first, say) could take it before the service binds it (a
    decode worker's metrics port was lost so on an H200 run of `stack_overhead`)."""
    low, _ = ephemeral_ports()
    for _ in range(200 if low - LOWEST_PORT >= 1000 else 0):
        port = random.randrange(LOWEST_PORT, low)
        if port in _picked:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _picked.add(port)
        return port
    with socket.socket() as s:  # no room below the range (or all taken): the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _has_password(url: str) -> bool:
    return urlsplit(url).password is not None


def is_serving(address: str, timeout_s: float = 1.0, tls: TlsConfig | None = None) -> bool:
    channel = grpc.secure_channel(address, tls.channel_credentials()) if tls else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def default_gpu_split(options: StackOptions) -> GpuSplit | None:
    """How prefill and decode workers share one GPU by default: through MPS with neither capped (kernels of both run
    side by side; on an H200 it kept disaggregation's goodput at 0.84-1.02x colocated up to 32 req/s where
    time-sharing fell to 0.2x: docs/architecture.md), when MPS is installed; else time-sharing (None)."""
    if not (options.auto_mps and options.device.startswith("cuda") and options.num_prefill and options.num_decode):
        return None
    if shutil.which(MPS_CONTROL) is None:
        print(f"tandem up: prefill and decode workers time-share the GPU ({MPS_CONTROL} is not on the PATH; MPS "
              "would run their kernels side by side)", file=sys.stderr)
        return None
    return GpuSplit(100, 100)


class Stack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.services: list[Service] = []
        self._stopping = False
        split = options.gpu_split if options.gpu_split is not None else default_gpu_split(options)
        self.mps = MpsDaemon(split) if split is not None else None
        # The stack's internal token (service-to-service auth), set by `_plan`: the one configured in the
        # environment, else a new one for this run. The children get it in their environment, never in argv.
        self.internal_token: str | None = None

    def _plan(self) -> None:
        o = self.options
        # One folder per run: stacks started side by side (tests, several users) never share a log file.
        run_name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        log_dir = o.log_dir or tandem_home() / "logs" / run_name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.internal_token = load_internal_token() or generate_token()
        base = [sys.executable, "-m", "tandem.cli"]
        common = ["--model", o.model]
        if o.redis_url and not _has_password(o.redis_url):
            common += ["--redis", o.redis_url]  # with a password: $TANDEM_REDIS_URL (`child_env`)
        engine_flags = ["--device", o.device, "--threads", str(o.threads), "--max-num-seqs", str(o.max_num_seqs)]
        shares: dict[str, float] = {}
        if o.device.startswith("cuda"):
            # Workers on one GPU split it: each sizes its KV pool from its own share.
            if o.gpu_memory_fraction:
                shares = {"prefill": o.gpu_memory_fraction, "decode": o.gpu_memory_fraction}
            else:
                shares = dict(zip(("prefill", "decode"), self.memory_shares(), strict=True))
        if o.num_kv_blocks:
            engine_flags += ["--num-kv-blocks", str(o.num_kv_blocks)]
        if o.max_model_len:
            engine_flags += ["--max-model-len", str(o.max_model_len)]
        if o.max_num_batched_tokens:
            engine_flags += ["--max-num-batched-tokens", str(o.max_num_batched_tokens)]
        if not o.enable_chunked_prefill:
            engine_flags += ["--no-chunked-prefill"]
        if o.prompt_tokens_while_decoding is not None:
            engine_flags += ["--prompt-tokens-while-decoding", str(o.prompt_tokens_while_decoding)]
        if not o.enable_prefix_caching:
            engine_flags += ["--no-prefix-caching"]
        if o.quantization:
            engine_flags += ["--quantization", o.quantization]
        if o.kv_cache_dtype != "auto":
            engine_flags += ["--kv-cache-dtype", o.kv_cache_dtype]
        if o.async_scheduling is not None:
            engine_flags += ["--async-scheduling" if o.async_scheduling else "--no-async-scheduling"]
        workers: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, count in (("prefill", o.num_prefill), ("decode", o.num_decode)):
            for i in range(count):
                port, http_port = free_port(o.host), free_port(o.host)
                address = f"{o.host}:{port}"
                workers[role].append(address)
                decode_flags = ["--kv-transport", o.kv_transport]
                if o.speculative_config:
                    decode_flags += ["--speculative-config", o.speculative_config]
                for peer in workers["prefill"]:  # the prefill workers it may pull from (planned first)
                    decode_flags += ["--prefill", peer]
                # On one GPU each role sizes its pool from its share, and a prefill worker takes decode's step budget
                # unless one was given (`memory_shares` sized its pool for that budget).
                on_one_gpu = ["--gpu-memory-fraction", str(shares[role])] if shares else []
                if role == "prefill" and shares and not o.max_num_batched_tokens:
                    on_one_gpu += ["--max-num-batched-tokens", str(SHARED_GPU_PREFILL_BATCHED_TOKENS)]
                self.services.append(Service(
                    role, address, f"http://{o.host}:{http_port}",
                    base + [role, *common, *engine_flags, *on_one_gpu, "--host", o.host, "--port", str(port),
                            "--http-port", str(http_port)] + (decode_flags if role == "decode" else []),
                    log_dir / f"{role}-{i}.log"))
        if o.shares_weights:
            for service in self.services:
                if service.role == "prefill":
                    service.command += ["--weights-from", workers["decode"][0]]
        # Port 0 means "pick a free one": picked here, so that the launcher knows where the gateway listens.
        gateway_port = o.gateway_port or free_port(o.host)
        gateway_http_port = o.gateway_http_port or free_port(o.host)
        gateway = base + ["gateway", *common, "--host", o.host, "--port", str(gateway_port),
                          "--http-port", str(gateway_http_port)]
        if o.max_model_len:
            gateway += ["--max-model-len", str(o.max_model_len)]
        if o.max_request_bytes is not None:
            gateway += ["--max-request-bytes", str(o.max_request_bytes)]
        if o.decode_stall_timeout_s is not None:
            gateway += ["--decode-stall-timeout", str(o.decode_stall_timeout_s)]
        gateway += ["--stream-interval", str(o.stream_interval)]
        gateway += ["--max-stream-interval", str(o.max_stream_interval)]
        gateway += ["--local-prefill-max-tokens", str(o.local_prefill_max_tokens)]
        gateway += ["--workers", str(o.gateway_workers or default_num_workers())]
        if not o.redis_url:
            for address in workers["prefill"]:
                gateway += ["--prefill", address]
            for address in workers["decode"]:
                gateway += ["--decode", address]
        self.services.insert(0, Service("gateway", f"{o.host}:{gateway_port}",
                                        f"http://{o.host}:{gateway_http_port}", gateway, log_dir / "gateway.log"))

    def memory_shares(self) -> tuple[float, float]:
        """Each prefill and decode worker's fraction of the GPU (`gpu_memory_shares`); an even split when the model's
        shape or the GPU's memory cannot be read here."""
        from tandem.models import load_model_config

        o = self.options
        try:
            model = load_model_config(o.model, fetch=False)
        except Exception:  # the worker reports a bad model itself; the shares need only a shape
            return gpu_memory_shares(None, 0, o.num_prefill, o.num_decode, 0, 0, budget=o.gpu_memory_budget,
                                     shared_weights=o.shares_weights)
        # `tandem.engine.kv_cache.bytes_per_block` of one token, without torch in this process: a GPU's pages are
        # fp8 or bf16.
        kv_per_token = (2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
                        * (1 if o.kv_cache_dtype == "fp8" else 2))
        return gpu_memory_shares(model, gpu_total_bytes(), o.num_prefill, o.num_decode,
                                 o.max_num_batched_tokens or SHARED_GPU_PREFILL_BATCHED_TOKENS, kv_per_token,
                                 o.quantization, budget=o.gpu_memory_budget, shared_weights=o.shares_weights)

    def child_env(self, role: str) -> dict[str, str]:
        """The environment a service of this stack runs in: ours, with the stack's internal token (planned)."""
        assert self.internal_token is not None, "planned first"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(INTERNAL_TOKEN_FILE_ENV, None)  # the token itself, resolved once here: one source for all
        env[INTERNAL_TOKEN_ENV] = self.internal_token
        env.pop(REDIS_URL_ENV, None)  # the stack's registry is `options.redis_url`, whatever the shell says
        if self.options.redis_url and _has_password(self.options.redis_url):
            env[REDIS_URL_ENV] = self.options.redis_url
        if self.mps is not None:
            env.update(self.mps.env_for(role))
        return env

    def _spawn(self, service: Service) -> None:
        env = self.child_env(service.role)
        with service.log_path.open("wb") as log:
            service.process = subprocess.Popen(service.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               stdin=subprocess.DEVNULL)

    def start(self) -> None:
        """Workers first, then the gateway, so its first look at the registry finds them up. On failure, whatever
        it started is stopped before the error goes on."""
        from tqdm import tqdm

        # Fetch (and convert) a preset once here, with a progress bar, rather than in every process at once.
        from tandem.models import load_model_config

        load_model_config(self.options.model)
        self._plan()
        try:
            if self.mps is not None:
                self.mps.start()
            gateway, workers = self.services[0], self.services[1:]
            with tqdm(total=len(self.services), desc="starting services", unit="svc", file=sys.stderr) as bar:
                for service in workers:
                    self._spawn(service)
                self._wait_healthy(workers, bar)
                self._spawn(gateway)
                self._wait_healthy([gateway], bar)
        except BaseException:
            # A service that failed to come up (or an interrupt) stops the ones already started: a caller that
            # never reaches `stop()` must not leave workers running (and holding ports and GPU memory).
            self.stop()
            raise

    def _wait_healthy(self, services: list[Service], bar: Any) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        pending = list(services)
        while pending:
            for service in list(pending):
                assert service.process is not None
                if service.process.poll() is not None:
                    raise RuntimeError(f"{service.role} exited with {service.process.returncode} during "
                                       f"start-up; see {service.log_path}")
                if is_serving(service.grpc):
                    pending.remove(service)
                    bar.update()
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {self.options.startup_timeout_s:.0f} s: "
                                   + ", ".join(s.role for s in pending))
            time.sleep(0.2)

    def report(self) -> None:
        for service in self.services:
            assert service.process is not None
            print(f"{service.role:<8} pid={service.process.pid:<7} grpc={service.grpc:<21} http={service.http}"
                  f"  log={service.log_path}", flush=True)
        if self.options.status_file is not None:
            status = {"services": [s.as_json() for s in self.services]}
            self.options.status_file.write_text(json.dumps(status, indent=2) + "\n")

    def stop(self, grace_s: float = 20.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + grace_s
        # Prefill workers that map a decode worker's weights must end before it does (its memory is theirs).
        phases = ([[s for s in self.services if s.role != "decode"], [s for s in self.services if s.role == "decode"]]
                  if self.options.shares_weights else [self.services])
        for phase in phases:
            for service in phase:
                if service.process is not None and service.process.poll() is None:
                    service.process.send_signal(signal.SIGTERM)
            for service in phase:
                if service.process is None:
                    continue
                try:
                    service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    service.process.kill()
                    service.process.wait()
        if self.mps is not None:
            self.mps.stop()

    def watch(self) -> None:
        """Until a signal: report (once) any service that died; the rest keep serving."""
        while not self._stopping:
            for service in self.services:
                assert service.process is not None
                code = service.process.poll()
                if code is not None and not service.reported_exit:
                    service.reported_exit = True
                    print(f"{service.role} pid={service.process.pid} exited with {code}; see {service.log_path}",
                          file=sys.stderr, flush=True)
            time.sleep(0.5)

    def run(self, demo: str | None = None, exit_after_demo: bool = False) -> int:
        def on_signal(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_signal)
        try:
            self.start()
            self.report()
            if demo is not None:
                from tandem.gateway.client import stream_reply

                print(f"\n> {demo}", flush=True)
                stream_reply(self.services[0].grpc, demo, max_tokens=64, temperature=0.0)
                if exit_after_demo:
                    return 0
            print("\nthe stack is up; Ctrl-C stops it", file=sys.stderr, flush=True)
            self.watch()
        except KeyboardInterrupt:
            pass
        except (RuntimeError, TimeoutError, ConfigError) as error:
            print(f"tandem up: {error}", file=sys.stderr)
            return 1
        finally:
            self.stop()
        return 0

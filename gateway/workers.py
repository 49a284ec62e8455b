"""`tandem gateway --workers N`: N gateway processes serving one gRPC port and one HTTP port.

One gateway process spends its CPU per client message (gRPC's own send, a `sendmsg` per message, and the
request's Python), so one event loop caps the tokens per second a stack can stream (docs/architecture.md, "The
gateway's processes"). Gateways share nothing but the registry, so several processes on one machine scale it:

- Every process binds the same ports with SO_REUSEPORT (gRPC core sets it by default, option `grpc.so_reuseport`;
  the HTTP socket sets it in `start_http_server`), and the kernel spreads *connections* among the processes. A
  client connection, with every stream it multiplexes, stays with one process.
- Each process is a whole gateway: its own view of the workers (its own probes, or its own Redis reads), its own
  `Decode.Session` to every decode worker, its own router (KV-aware routing counts this process's placements at
  once, the others' when the workers next report them), its own `--max-concurrent-requests` (per process: at most
  N × the limit in all; a client whose streams share one connection gets one process's limit).
- This process only supervises: it picks the ports when asked for port 0 (and holds each, bound with SO_REUSEPORT
  and not listening, until it exits, so that nothing else takes them), starts the processes (spawned: a fresh
  interpreter each), prints one ready line once every one is serving, forwards SIGTERM and SIGINT (each process
  drains as a single gateway does), restarts a process that dies after it was serving, and stops them all if one
  fails to start. A process whose supervisor is gone drains and exits.
- Metrics: prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, a fresh folder per supervisor, removed
  when it exits): each process writes its samples to memory-mapped files there, and `/metrics`, whichever process
  answers it, reports all of them (counters and histograms summed; gauges one series per process, `pid` label).
- Traces: each process exports its own spans, with the resource attribute `tandem.gateway.worker` (its index).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from tandem.common.debug import dump_stacks_on_sigusr1
from tandem.gateway.limits import GatewayLimits
from tandem.serving.service import ServiceOptions

log = logging.getLogger(__name__)

# `tandem up`'s number of gateway processes (and `tandem gateway --workers 0`'s): one per this many CPUs, at most
# MAX_DEFAULT_WORKERS, at least one.
CPUS_PER_WORKER = 4
MAX_DEFAULT_WORKERS = 4
# prometheus_client's multiprocess mode: set (by the supervisor) in each gateway process, read by `/metrics`.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
WORKER_ATTRIBUTE = "tandem.gateway.worker"
# A process that dies after it was serving is started again, at most once per this many seconds.
RESTART_DELAY_S = 1.0
# How often a process checks that its supervisor is still there.
_PARENT_CHECK_S = 1.0
# What a process may take beyond --drain-s to stop (closing its channels, exporting its spans) before it is killed.
_STOP_GRACE_S = 10.0


def available_cpus() -> int:
    """CPUs this process may run on (its affinity: a container's cpuset counts, a CPU quota does not)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_num_workers(cpus: int | None = None) -> int:
    """Gateway processes for a machine of `cpus` CPUs (default: this one's): one per 4 CPUs, between 1 and 4
    (2 CPUs: 1, 8: 2, 16 or more: 4). The rest of the CPUs are for the workers' engine and event-loop threads."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // CPUS_PER_WORKER))


@dataclass(frozen=True)
class GatewayArgs:
    """`tandem.gateway.server.serve`'s arguments, as each process gets them (pickled: they cross to the spawned
    processes)."""

    service: ServiceOptions
    model: str
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    max_model_len: int | None = None
    max_concurrent_requests: int = 1024
    api_keys: frozenset[str] = frozenset()
    limits: GatewayLimits = field(default_factory=GatewayLimits)


def reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port of `host` with SO_REUSEPORT, not listening: it keeps the port for the gateway's
    processes (which bind it with SO_REUSEPORT too) without taking any of its connections."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), 0))
    except OSError:
        sock.close()
        raise
    return sock


def run_workers(args: GatewayArgs, num_workers: int) -> int:
    """Serve `args` from `num_workers` processes until SIGTERM or SIGINT; the exit code (0: stopped as asked)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    service = args.service
    # Port 0 means "pick a free one": picked here, once for all the processes, and held until they have exited.
    reserved: list[socket.socket] = []
    ports = []
    for port in (service.port, service.http_port):
        if port == 0:
            reserved.append(reserve_port(service.host))
            port = int(reserved[-1].getsockname()[1])
        ports.append(port)
    service = replace(service, port=ports[0], http_port=ports[1])
    metrics_dir = tempfile.mkdtemp(prefix="tandem-gateway-metrics-")
    previous_dir = os.environ.get(METRICS_DIR_ENV)
    os.environ[METRICS_DIR_ENV] = metrics_dir  # the spawned processes inherit it
    try:
        return _Supervisor(replace(args, service=service), num_workers, metrics_dir).run()
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if previous_dir is None:
            os.environ.pop(METRICS_DIR_ENV, None)
        else:
            os.environ[METRICS_DIR_ENV] = previous_dir


@dataclass(eq=False)
class _Worker:
    index: int
    process: BaseProcess
    ready: Connection | None  # where the process reports that it is serving; None once read (or at its EOF)
    started_at: float
    serving: bool = False
    restarted: bool = False


class _Supervisor:
    def __init__(self, args: GatewayArgs, num_workers: int, metrics_dir: str) -> None:
        self.args = args
        self.num_workers = num_workers
        self.metrics_dir = metrics_dir
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.signalled: int | None = None

    def run(self) -> int:
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        try:
            self.workers = [self._start(i) for i in range(self.num_workers)]
            if not self._wait_serving(wake_read):
                return 1 if self.signalled is None else 0
            service = self.args.service
            print(f"tandem gateway ready grpc={service.host}:{service.port} http=http://{service.host}:"
                  f"{service.http_port} workers={self.num_workers}", flush=True)
            self._supervise(wake_read)
            return 0
        finally:
            self._stop_all()
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            os.close(wake_read)
            os.close(wake_write)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signum

    def _start(self, index: int) -> _Worker:
        ready_read, ready_write = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_worker_main, args=(index, self.args, ready_write, os.getpid()),
                                       name=f"tandem-gateway-{index}")
        process.start()
        ready_write.close()  # the process has its own end: ours reads EOF once it is gone
        return _Worker(index, process, ready_read, time.monotonic())

    def _wait_serving(self, wake: int) -> bool:
        """Until every process serves (True), one exits before they all do (False: all are stopped), or a signal
        comes (False)."""
        while not all(w.serving for w in self.workers):
            if self.signalled is not None:
                return False
            waiting = [w.ready for w in self.workers if w.ready is not None]
            wait([*waiting, *(w.process.sentinel for w in self.workers), wake])
            _drain(wake)
            for worker in self.workers:
                self._check_ready(worker)
                if not worker.process.is_alive():
                    log.error("gateway process %d exited with %s while the gateway was starting; stopping the others",
                              worker.index, worker.process.exitcode)
                    return False
        return True

    def _check_ready(self, worker: _Worker) -> None:
        if worker.ready is None or not worker.ready.poll():
            return
        try:
            worker.ready.recv()
            worker.serving = True
            if worker.restarted:
                log.info("gateway process %d (pid %s) is serving again", worker.index, worker.process.pid)
        except EOFError:  # it exited before it was serving (its sentinel tells the rest)
            pass
        worker.ready.close()
        worker.ready = None

    def _supervise(self, wake: int) -> None:
        """Until a signal: start again each process that dies (not sooner than RESTART_DELAY_S after its start)."""
        while self.signalled is None:
            now = time.monotonic()
            dead = [w for w in self.workers if not w.process.is_alive()]
            due = [w for w in dead if now >= w.started_at + RESTART_DELAY_S]
            for worker in due:
                log.error("gateway process %d (pid %s) exited with %s; starting it again", worker.index,
                          worker.process.pid, worker.process.exitcode)
                self._forget(worker)
                self.workers[worker.index] = self._start(worker.index)
                self.workers[worker.index].restarted = True
            timeout = None
            if len(due) < len(dead):
                timeout = max(0.0, min(w.started_at + RESTART_DELAY_S for w in dead if w not in due) - now)
            # The sentinels of all but those dead at the snapshot above: one that died since then wakes the wait.
            alive = [w for w in self.workers if w not in dead]
            readying = [w.ready for w in self.workers if w.ready is not None]
            wait([*(w.process.sentinel for w in alive), *readying, wake], timeout)
            _drain(wake)
            for worker in self.workers:
                self._check_ready(worker)

    def _forget(self, worker: _Worker) -> None:
        """A process is gone: its gauges that count only while it lives go (counters and histograms stay)."""
        from prometheus_client import multiprocess

        if worker.ready is not None:
            worker.ready.close()
            worker.ready = None
        if worker.process.pid is not None:
            multiprocess.mark_process_dead(worker.process.pid, self.metrics_dir)

    def _stop_all(self) -> None:
        """SIGTERM to every process (each drains for up to --drain-s), then wait; kill what is left after that."""
        for worker in self.workers:
            if worker.process.is_alive() and worker.process.pid is not None:
                os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.args.service.drain_s + _STOP_GRACE_S
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.error("gateway process %d did not stop in time; killing it", worker.index)
                worker.process.kill()
                worker.process.join()
            if worker.ready is not None:
                worker.ready.close()
                worker.ready = None


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


# -- in each gateway process -------------------------------------------------------------------------------------
def _worker_main(index: int, args: GatewayArgs, ready: Connection, supervisor_pid: int) -> None:
    dump_stacks_on_sigusr1()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s gateway[{index}] %(levelname)s %(name)s: %(message)s")
    # The processes share service.name and service.instance.id (the address): this tells their spans apart.
    attributes = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip().strip(",")
    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(filter(None, [attributes, f"{WORKER_ATTRIBUTE}={index}"]))
    asyncio.run(_serve_worker(args, ready, supervisor_pid))


async def _serve_worker(args: GatewayArgs, ready: Connection, supervisor_pid: int) -> None:
    from tandem.gateway.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def on_started(address: str, http_port: int) -> None:
        ready.send(os.getpid())
        ready.close()

    orphaned = loop.create_task(_stop_without(supervisor_pid, stop))
    try:
        await serve(args.service, args.model, args.prefill, args.decode, args.max_model_len,
                    max_concurrent_requests=args.max_concurrent_requests, api_keys=args.api_keys,
                    limits=args.limits, on_started=on_started, stop=stop, reuse_port=True)
    finally:
        orphaned.cancel()


async def _stop_without(supervisor_pid: int, stop: asyncio.Event) -> None:
    """Drain once the supervisor is gone (killed: nobody would stop this process otherwise)."""
    while os.getppid() == supervisor_pid:
        await asyncio.sleep(_PARENT_CHECK_S)
    log.warning("the supervising process %d is gone: draining", supervisor_pid)
    stop.set()


def resolve_num_workers(num_workers: int, cpus: int | None = None) -> int:
    """`--workers`: 0 means `default_num_workers()`."""
    if num_workers < 0:
        raise ValueError(f"workers must be 0 (from the CPU count) or more, got {num_workers}")
    return num_workers or default_num_workers(cpus)

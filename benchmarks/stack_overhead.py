"""Stack overhead: the offline engine against the full gateway → prefill → decode stack, same workload.

    python -m tandem.benchmarks.stack_overhead --model dummy:tiny --num-requests 256 \\
        --prompt-len fixed:32 --output-len fixed:128 --out benchmarks/results/stack-overhead-cpu.json

The engine runs the requests through `LLM.generate` (one process, no transport); the stack is started
with `tandem up` (1 prefill, 1 decode, the gateway with `--gateway-workers` processes, by default `tandem up`'s;
`--prefill-workers 0`: colocated)
and gets the same requests as one burst through the public gRPC API (`tandem bench serve`'s client). Both ignore
EOS, so both generate exactly the same tokens. Reported: output tokens/s of each, the stack's share of the
engine's (the issue's target on a GPU: >= 90%), and each service's CPU time per output token (its processes
together, and their event-loop threads), which tells how fast an engine each could keep up with; the gateway's
is printed on its own line and kept as `gateway_cpu_us_per_output_token` (median of the runs). `--repeat`
interleaves runs and reports medians (timing on a shared machine is noisy).

The gateway alone, at the rate of an engine faster than this machine's (what decides a GPU stack's share):

    python -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 --num-requests 256 --output-len fixed:128

runs `tandem gateway --workers N` over a decode worker with no engine (`FakeDecode`, in this process): every
step it adds a token to each running request and, as a real worker's writer does, sends what accumulated since its
last message. Reported: the gateway's output tokens/s and its CPU per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
import torch

import tandem
from tandem import LLM, SamplingParams
from tandem.benchmarks.serve import LengthDist, default_client_processes, run_rate, workload
from tandem.common.debug import dump_stacks_on_sigusr1
from tandem.gateway.limits import DEFAULT_MAX_STREAM_INTERVAL
from tandem.gateway.workers import default_num_workers
from tandem.launcher import Stack, StackOptions, free_port, is_serving
from tandem.models import load_model_config, load_tokenizer
from tandem.serving.profiling import IDLE_GAP_S
from tandem.serving.rpc import start_server
from tandem.serving.service import session_window
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

# What the fake decode worker "generates" (token ids of it, in a loop): text as a model writes it.
# The fraction of the GPU the stack's workers and the offline engine beside them take together.
GPU_SHARE = 0.88
# The warm-up burst's seed, this far from `--seed` (run i uses --seed + i).
WARM_UP_SEED_OFFSET = 10_000

_FAKE_TEXT = ("Disaggregated serving splits prompt processing and generation into pools that scale on their own. "
              "The gateway tokenizes, routes and streams text back to clients — «quickly», even with accents, "
              "emoji 🙂 and numbers like 3.14159 or 2,048. ")


def run_engine(llm: LLM, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    prompts = [prompt for prompt, _ in requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": num_tokens, "output_tok_per_s": num_tokens / seconds}


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of a process and of its main thread, whose event loop does the service's per-token work
    (Linux /proc; empty elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def read(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    try:
        return {"process": read(f"/proc/{pid}/stat"), "event_loop": read(f"/proc/{pid}/task/{pid}/stat")}
    except OSError:
        return {}


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (a gateway's worker processes), from Linux /proc (elsewhere: `pid`)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pid]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


# A load-generator process busier than this share of a core (its grpc threads included) may be what set the pace.
CLIENT_BOUND_SHARE = 0.9


def client_load(result: dict[str, Any]) -> str:
    """The load generator's CPU over a run, in cores, with a warning when its processes were near a core each (then
    it, not the stack, may have set the pace: add --client-processes)."""
    cores = result["client_cpu_s"] / result["duration_s"]
    processes = result["client_processes"]
    bound = cores >= CLIENT_BOUND_SHARE * processes
    return (f"load generator: {processes} process(es), {cores:.2f} cores"
            + ("; WARNING: near a core per process, it may be the limit (--client-processes)" if bound else ""))


def run_stack(stack: Stack, address: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One burst through the stack (the workload of `seed`); with each service's CPU microseconds per output token
    (its event-loop threads, and its processes: all of a gateway's), which say which service would fall behind a
    faster engine first."""
    trees = {s.role: process_tree(s.process.pid) for s in stack.services if s.process is not None}
    before = {role: {pid: cpu_seconds(pid) for pid in pids} for role, pids in trees.items()}
    result = asyncio.run(run_rate(address, float("inf"), args.num_requests, LengthDist.parse(args.prompt_len),
                                  LengthDist.parse(args.output_len), seed, timeout=args.timeout,
                                  processes=args.client_processes))
    after = {role: {pid: cpu_seconds(pid) for pid in pids} for role, pids in trees.items()}
    result.pop("records")
    if result["errors"]:
        raise RuntimeError(f"the stack failed requests: {result['errors']}")
    num_tokens = result["output_tok_per_s"] * result["duration_s"]

    def used(role: str, part: str) -> float:
        return sum(after[role][pid][part] - before[role][pid][part] for pid in trees[role]
                   if part in before[role][pid] and part in after[role][pid])

    result["cpu_us_per_output_token"] = {role: {part: used(role, part) / num_tokens * 1e6
                                                for part in ("event_loop", "process")}
                                         for role in trees if any(before[role].values())}
    result["num_processes"] = {role: len(pids) for role, pids in trees.items()}
    return result


# -- the gateway alone -----------------------------------------------------------------------------------------
class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """A decode worker with no engine (`--fake-decode-step-ms`): every step it adds one token to each running request
    of a session, and its writer sends everything that accumulated since its last message, as
    `tandem.decode_svc.sessions` does, so that a gateway that lags gets fewer, larger messages. A request's first
    and last tokens come in updates, the others in the message's columns when the gateway gave it a slot."""

    def __init__(self, model: str, step_s: float, max_model_len: int) -> None:
        config = load_model_config(model)
        self.step_s = step_s
        self.text_ids = load_tokenizer(config).encode(_FAKE_TEXT)
        self.info = worker_pb2.WorkerInfo(role="decode", model=model, layout=worker_pb2.KVLayout(
            model_fingerprint="fake"), num_free_blocks=1 << 20, num_total_blocks=1 << 20, max_model_len=max_model_len,
            vocab_size=config.vocab_size)

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return self.info

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SessionResponse]:
        running: dict[str, list[int]] = {}  # request id → [tokens sent, max_tokens, slot, first token sent]
        pending = worker_pb2.SessionResponse()
        open_updates: dict[str, worker_pb2.SessionUpdate] = {}  # each request's update in `pending`
        ready, busy = asyncio.Event(), asyncio.Event()
        window = session_window(context.invocation_metadata())  # as the worker's writer: at most this many unacked
        num_unacked = 0

        async def read() -> None:
            nonlocal num_unacked
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "ack":
                    num_unacked = max(num_unacked - message.ack.num_messages, 0)
                    ready.set()
                elif kind == "start":
                    request = message.start.request
                    running[request.request_id] = [len(request.output_token_ids), request.sampling.max_tokens,
                                                   message.start.slot, 0]
                    busy.set()
                else:
                    running.pop(message.cancel.request_id, None)

        async def step() -> None:
            while True:
                if not running:
                    busy.clear()
                    await busy.wait()
                await asyncio.sleep(self.step_s)
                columns = pending.tokens
                for request_id, state in list(running.items()):
                    token_id = self.text_ids[state[0] % len(self.text_ids)]
                    state[0] += 1
                    last = state[0] >= state[1]
                    update = open_updates.get(request_id)
                    if update is None and state[2] and state[3] and not last:
                        # A steady token of a request with a slot: in the columns, as the engine thread puts it.
                        columns.slots.append(state[2])
                        columns.token_ids.append(token_id)
                        columns.logprobs.append(-1.0)
                        continue
                    if update is None:
                        update = open_updates[request_id] = pending.updates.add(request_id=request_id)
                    update.response.token_ids.append(token_id)
                    update.response.logprobs.append(-1.0)
                    state[3] = 1
                    if last:
                        update.response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                        del running[request_id]
                ready.set()

        tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(step())]
        try:
            while True:
                await ready.wait()
                ready.clear()
                if window and num_unacked >= window:
                    continue  # an ack sets `ready`
                if not pending.updates and not pending.tokens.slots:
                    continue  # woken by an ack with nothing new (the worker's writer sends nothing then either)
                message, pending = pending, worker_pb2.SessionResponse()
                open_updates.clear()
                num_unacked += 1
                yield message
        finally:
            for task in tasks:
                task.cancel()


BARE_TOKEN_ID = 64  # what `--bare-gateway`'s server streams: any id of any vocabulary


class BareGeneration(generation_pb2_grpc.GenerationServicer):
    """`--bare-gateway`: the floor under the gateway's own cost, gRPC's per call. A grpc.aio server with tandem's
    server options (`start_server`) whose `Generate` does nothing but stream: one token per fake step, as many as
    the request asks (what the gateway over `FakeDecode` sends when it keeps up), no tokenizer, routing, session or
    limits. The gateway's CPU per request less this one's is what tandem's own code adds."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        num_tokens = max(request.sampling.max_tokens, 1)
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(self.step_s)
            response = generation_pb2.GenerateResponse(request_id=request.request_id, text="a",
                                                       token_ids=[BARE_TOKEN_ID])
            if i == num_tokens - 1:
                response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            await context.write(response)


def serve_bare_gateway(port: int, step_s: float) -> None:
    """The process `--bare-gateway` starts in place of `tandem gateway` (`--serve-bare-gateway PORT`)."""
    async def main() -> None:
        def register(server: grpc.aio.Server) -> list[str]:
            generation_pb2_grpc.add_GenerationServicer_to_server(BareGeneration(step_s), server)
            return ["tandem.v1.Generation"]

        server, _, _ = await start_server(f"127.0.0.1:{port}", register)
        await server.wait_for_termination()

    asyncio.run(main())


async def run_gateway_only(args: argparse.Namespace, gateway_workers: int) -> list[dict[str, Any]]:
    """`--repeat` bursts through `tandem gateway --workers N` over a `FakeDecode` (both served from this event loop
    and the load generator's), each with the gateway's CPU per output token."""
    fake = FakeDecode(args.model, args.fake_decode_step_ms / 1e3, args.max_model_len)

    def register(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeServicer_to_server(fake, server)
        return ["tandem.v1.Decode"]

    server, decode_port, _ = await start_server("127.0.0.1:0", register)
    port = free_port("127.0.0.1")
    log = tempfile.NamedTemporaryFile(prefix="tandem-gateway-", suffix=".log", delete=False)  # noqa: SIM115
    if args.bare_gateway:
        command = [sys.executable, "-m", "tandem.benchmarks.stack_overhead", "--serve-bare-gateway", str(port),
                   "--fake-decode-step-ms", str(args.fake_decode_step_ms)]
    else:
        command = [sys.executable, "-m", "tandem.cli", "gateway", "--model", args.model, "--decode",
                   f"127.0.0.1:{decode_port}", "--port", str(port), "--http-port", str(free_port("127.0.0.1")),
                   "--max-model-len", str(args.max_model_len), "--workers", str(gateway_workers),
                   "--stream-interval", str(args.stream_interval), "--max-stream-interval",
                   str(args.max_stream_interval)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    runs: list[dict[str, Any]] = []
    try:
        while not await asyncio.to_thread(is_serving, address):
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {process.returncode}; see {log.name}")
            await asyncio.sleep(0.2)
        prompts, outputs = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
        await run_rate(address, float("inf"), 8, prompts, outputs, args.seed, timeout=args.timeout)  # warm-up
        for i in range(args.repeat):
            pids = process_tree(process.pid)
            before = {pid: cpu_seconds(pid) for pid in pids}
            result = await run_rate(address, float("inf"), args.num_requests, prompts, outputs, args.seed,
                                    timeout=args.timeout, processes=args.client_processes)
            after = {pid: cpu_seconds(pid) for pid in pids}
            result.pop("records")
            if result["errors"]:
                raise RuntimeError(f"the gateway failed requests: {result['errors']}")
            num_tokens = result["output_tok_per_s"] * result["duration_s"]
            result["cpu_us_per_output_token"] = {"gateway": {
                part: sum(after[pid][part] - before[pid][part] for pid in pids
                          if part in before[pid] and part in after[pid]) / num_tokens * 1e6
                for part in ("event_loop", "process")}}
            result["num_processes"] = {"gateway": len(pids)}
            runs.append(result)
            print(f"run {i + 1}/{args.repeat}: gateway {result['output_tok_per_s']:,.0f} tok/s, "
                  f"{result['cpu_us_per_output_token']['gateway']['process']:.1f} µs CPU per output token "
                  f"({client_load(result)})", flush=True)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait)
        await server.stop(0)
        log.close()
    return runs


def main() -> None:
    dump_stacks_on_sigusr1()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", default="fixed:32")
    parser.add_argument("--output-len", default="fixed:128")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the engine and of each worker")
    parser.add_argument("--gateway-workers", type=int, default=None,
                        help="gateway processes (`tandem up --gateway-workers`); default: tandem up's, one per 4 "
                             f"CPUs between 1 and 4 (here: {default_num_workers()})")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the gateway's --stream-interval (tokens per client message after the first)")
    parser.add_argument("--max-stream-interval", type=int, default=DEFAULT_MAX_STREAM_INTERVAL,
                        help="the gateway's --max-stream-interval (the most it goes to while saturated; 1: off; "
                             "default: the gateway's)")
    parser.add_argument("--prefill-workers", type=int, default=1,
                        help="prefill workers of the stack (`tandem up --prefill`); 0: colocated, decode prefills")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the stack's workers' step budget (`tandem up --max-num-batched-tokens`); default tandem "
                             "up's (on one GPU 2,048 for both roles)")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=0,
                        help="the gateway's --local-prefill-max-tokens (prompts this short are prefilled on decode)")
    parser.add_argument("--client-processes", type=int, default=default_client_processes(),
                        help="load-generator processes the burst's requests are dealt to (one Python process receives "
                             "a few tens of thousands of messages a second at most); default one per 4 CPUs between "
                             f"1 and 4 (here: {default_client_processes()})")
    parser.add_argument("--seed", type=int, default=0,
                        help="run i's prompts come from seed + i (the engine's and the stack's alike), the warm-up's "
                             f"from seed + {WARM_UP_SEED_OFFSET}")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved runs of each; medians reported")
    parser.add_argument("--label", default="", help="what this run measures (e.g. the commit or variant)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fake-decode-step-ms", type=float, default=None,
                        help="measure the gateway alone, over a decode worker with no engine that makes a step (a "
                             "token for every running request) this often; no prefill worker, no engine run")
    parser.add_argument("--bare-gateway", action="store_true",
                        help="with --fake-decode-step-ms: a bare grpc.aio Generate server in place of the gateway "
                             "(one token per step, nothing else): gRPC's own cost per call, for comparison")
    parser.add_argument("--serve-bare-gateway", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare_gateway is not None:
        serve_bare_gateway(args.serve_bare_gateway, (args.fake_decode_step_ms or 0.0) / 1e3)
        return
    if args.bare_gateway and args.fake_decode_step_ms is None:
        parser.error("--bare-gateway needs --fake-decode-step-ms")
    if args.fake_decode_step_ms is not None:
        gateway_only(args)
        return

    def requests_of(seed: int, num_requests: int = args.num_requests) -> list[tuple[list[int], int]]:
        return list(workload(num_requests, LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len), seed))

    port = free_port("127.0.0.1")
    gateway_workers = args.gateway_workers or default_num_workers()
    options = StackOptions(model=args.model, device=args.device, gateway_port=port,
                           gateway_http_port=free_port("127.0.0.1"), max_model_len=args.max_model_len,
                           max_num_seqs=args.max_num_seqs, threads=args.threads,
                           max_num_batched_tokens=args.max_num_batched_tokens, gateway_workers=gateway_workers,
                           stream_interval=args.stream_interval, max_stream_interval=args.max_stream_interval,
                           local_prefill_max_tokens=args.local_prefill_max_tokens, num_prefill=args.prefill_workers)
    engine_fraction = 0.85
    if args.device.startswith("cuda"):
        # The stack and the offline engine share the GPU: the engine gets the decode worker's share, so both have
        # the same KV pool, and the three processes take GPU_SHARE together.
        # Colocated (`--prefill-workers 0`): decode and the engine half of it each.
        prefill_share = Stack(options).memory_shares()[0] if args.prefill_workers else 0.0
        options = dataclasses.replace(options, gpu_memory_budget=(GPU_SHARE + args.prefill_workers * prefill_share) / 2)
        engine_fraction = Stack(options).memory_shares()[1]
        print(f"GPU memory: prefill {prefill_share:.3f}, decode and engine {engine_fraction:.3f} each", flush=True)
    stack = Stack(options)
    engine_runs: list[dict[str, float]] = []
    stack_runs: list[dict[str, Any]] = []
    stack.start()
    try:
        torch.set_num_threads(args.threads)
        llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  gpu_memory_fraction=engine_fraction)
        llm.engine.warm_up()  # as a worker's engine is warmed before it reports healthy (kernels, the largest step)
        # Every burst has prompts of its own (a seed each; the engine and the stack the same ones per run): a burst
        # that repeated earlier prompts would find them in the prefix caches and measure a different workload.
        warm_up_seed = args.seed + WARM_UP_SEED_OFFSET
        run_engine(llm, requests_of(warm_up_seed, 8))  # warm-up (graphs, allocator, oneDNN packing)
        run_stack(stack, f"127.0.0.1:{port}", argparse.Namespace(**{**vars(args), "num_requests": 8}), warm_up_seed)
        # The workers idle past a busy period's end, so the warm-up is period 1 of a worker's profiled steps and the
        # first measured burst period 2, however fast the engine's run in between (TANDEM_PROFILE_STEPS=...@2).
        time.sleep(IDLE_GAP_S * 1.5)
        for i in range(args.repeat):
            engine_runs.append(run_engine(llm, requests_of(args.seed + i)))
            stack_runs.append(run_stack(stack, f"127.0.0.1:{port}", args, args.seed + i))
            print(f"run {i + 1}/{args.repeat}: engine {engine_runs[-1]['output_tok_per_s']:,.0f} tok/s, "
                  f"stack {stack_runs[-1]['output_tok_per_s']:,.0f} tok/s ({client_load(stack_runs[-1])})",
                  flush=True)
    finally:
        stack.stop()
    engine_tps = statistics.median(r["output_tok_per_s"] for r in engine_runs)
    stack_tps = statistics.median(r["output_tok_per_s"] for r in stack_runs)
    gateway_cpu = [r["cpu_us_per_output_token"]["gateway"] for r in stack_runs
                   if "gateway" in r["cpu_us_per_output_token"]]
    report = {
        "benchmark": "stack_overhead", "label": args.label, "date": datetime.now(timezone.utc).isoformat(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "versions": {"tandem": tandem.__version__, "torch": torch.__version__, "grpcio": grpc.__version__,
                     "python": platform.python_version()},
        "machine": platform.processor() or platform.machine(),
        "engine": engine_runs, "stack": stack_runs,
        "engine_output_tok_per_s": engine_tps, "stack_output_tok_per_s": stack_tps,
        "stack_share_of_engine": stack_tps / engine_tps, "gateway_workers": gateway_workers,
        # All the gateway's processes together (with N > 1: N gateways, their supervisor, multiprocessing's resource
        # tracker), and their main (event-loop) threads.
        "gateway_cpu_us_per_output_token": statistics.median(c["process"] for c in gateway_cpu) if gateway_cpu
        else None,
        "gateway_event_loop_cpu_us_per_output_token": statistics.median(c["event_loop"] for c in gateway_cpu)
        if gateway_cpu else None,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'':<8}{'output tok/s':>14}")
    print(f"{'engine':<8}{engine_tps:>14,.0f}")
    print(f"{'stack':<8}{stack_tps:>14,.0f}   {stack_tps / engine_tps:.0%} of the engine")
    if gateway_cpu:
        print(f"gateway CPU per output token: {report['gateway_cpu_us_per_output_token']:.1f} µs "
              f"({gateway_workers} gateway process{'es' if gateway_workers > 1 else ''}; event loops "
              f"{report['gateway_event_loop_cpu_us_per_output_token']:.1f} µs; median of {len(gateway_cpu)})")
    cpu = stack_runs[-1]["cpu_us_per_output_token"]
    if any(cpu.values()):
        print("CPU µs per output token (last run): " + ", ".join(
            f"{role} {parts['event_loop']:.0f} event loop / {parts['process']:.0f} process"
            for role, parts in cpu.items() if parts))


def gateway_only(args: argparse.Namespace) -> None:
    gateway_workers = args.gateway_workers or default_num_workers()
    runs = asyncio.run(run_gateway_only(args, gateway_workers))
    cpu = [r["cpu_us_per_output_token"]["gateway"] for r in runs]
    report = {
        "benchmark": "stack_overhead", "mode": "bare_gateway" if args.bare_gateway else "gateway_only",
        "label": args.label,
        "date": datetime.now(timezone.utc).isoformat(), "args": {k: str(v) for k, v in vars(args).items()},
        "versions": {"tandem": tandem.__version__, "grpcio": grpc.__version__, "python": platform.python_version()},
        "machine": platform.processor() or platform.machine(), "gateway_workers": gateway_workers, "stack": runs,
        "stack_output_tok_per_s": statistics.median(r["output_tok_per_s"] for r in runs),
        "gateway_cpu_us_per_output_token": statistics.median(c["process"] for c in cpu),
        "gateway_event_loop_cpu_us_per_output_token": statistics.median(c["event_loop"] for c in cpu),
        "messages_per_output_token": statistics.median(r["messages_per_output_token"] for r in runs),
        "gateway_cpu_us_per_message": statistics.median(
            r["cpu_us_per_output_token"]["gateway"]["process"] / r["messages_per_output_token"] for r in runs),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    server = "bare grpc.aio server" if args.bare_gateway else "gateway"
    print(f"{server} alone ({gateway_workers} process{'es' if gateway_workers > 1 else ''}, a fake decode step every "
          f"{args.fake_decode_step_ms:g} ms): {report['stack_output_tok_per_s']:,.0f} output tok/s, "
          f"{report['gateway_cpu_us_per_output_token']:.1f} µs CPU per output token (event loops "
          f"{report['gateway_event_loop_cpu_us_per_output_token']:.1f} µs; median of {len(runs)}); "
          f"{report['messages_per_output_token']:.2f} client messages per token, "
          f"{report['gateway_cpu_us_per_message']:.1f} µs per message")


if __name__ == "__main__":
    main()

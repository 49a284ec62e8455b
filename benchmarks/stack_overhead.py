"""Stack overhead: the offline engine against the full gateway → prefill → decode stack, same workload.

    python -m tandem.benchmarks.stack_overhead --model dummy:tiny --num-requests 256 \\
        --prompt-len fixed:32 --output-len fixed:128 --out benchmarks/results/stack-overhead-cpu.json

The engine runs the requests through `LLM.generate` (one process, no transport); the stack is started
with `tandem up` (1 prefill, 1 decode, the gateway) and gets the same requests as one burst through the
public gRPC API (`tandem bench serve`'s client). Both ignore EOS, so both generate exactly the same
tokens. Reported: output tokens/s of each, the stack's share of the engine's (the issue's target on a
GPU: >= 90%), and each service's CPU time per output token (event-loop thread and process), which tells
how fast an engine each could keep up with. `--repeat` interleaves runs and reports medians (timing on a
shared machine is noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
import torch

import tandem
from tandem import LLM, SamplingParams
from tandem.benchmarks.serve import LengthDist, run_rate, workload
from tandem.launcher import Stack, StackOptions, free_port


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


def run_stack(stack: Stack, address: str, args: argparse.Namespace) -> dict[str, Any]:
    """One burst through the stack; with each service's CPU microseconds per output token (its event-loop
    thread, and the whole process), which say which service would fall behind a faster engine first."""
    pids = {s.role: s.process.pid for s in stack.services if s.process is not None}
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    result = asyncio.run(run_rate(address, float("inf"), args.num_requests, LengthDist.parse(args.prompt_len),
                                  LengthDist.parse(args.output_len), args.seed, timeout=args.timeout))
    after = {role: cpu_seconds(pid) for role, pid in pids.items()}
    result.pop("records")
    if result["errors"]:
        raise RuntimeError(f"the stack failed requests: {result['errors']}")
    num_tokens = result["output_tok_per_s"] * result["duration_s"]
    result["cpu_us_per_output_token"] = {
        role: {part: (after[role][part] - before[role][part]) / num_tokens * 1e6 for part in after[role]}
        for role in pids}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", default="fixed:32")
    parser.add_argument("--output-len", default="fixed:128")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the engine and of each worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved runs of each; medians reported")
    parser.add_argument("--label", default="", help="what this run measures (e.g. the commit or variant)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    requests = list(workload(args.num_requests, LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len),
                             args.seed))
    port = free_port("127.0.0.1")
    stack = Stack(StackOptions(model=args.model, device=args.device, gateway_port=port,
                               gateway_http_port=free_port("127.0.0.1"), max_model_len=args.max_model_len,
                               max_num_seqs=args.max_num_seqs, threads=args.threads))
    engine_runs: list[dict[str, float]] = []
    stack_runs: list[dict[str, Any]] = []
    stack.start()
    try:
        torch.set_num_threads(args.threads)
        llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
        run_engine(llm, requests[:8])  # warm-up (graphs, allocator, oneDNN packing)
        run_stack(stack, f"127.0.0.1:{port}", argparse.Namespace(**{**vars(args), "num_requests": 8}))
        for i in range(args.repeat):
            engine_runs.append(run_engine(llm, requests))
            stack_runs.append(run_stack(stack, f"127.0.0.1:{port}", args))
            print(f"run {i + 1}/{args.repeat}: engine {engine_runs[-1]['output_tok_per_s']:,.0f} tok/s, "
                  f"stack {stack_runs[-1]['output_tok_per_s']:,.0f} tok/s", flush=True)
    finally:
        stack.stop()
    engine_tps = statistics.median(r["output_tok_per_s"] for r in engine_runs)
    stack_tps = statistics.median(r["output_tok_per_s"] for r in stack_runs)
    report = {
        "benchmark": "stack_overhead", "label": args.label, "date": datetime.now(timezone.utc).isoformat(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "versions": {"tandem": tandem.__version__, "torch": torch.__version__, "grpcio": grpc.__version__,
                     "python": platform.python_version()},
        "machine": platform.processor() or platform.machine(),
        "engine": engine_runs, "stack": stack_runs,
        "engine_output_tok_per_s": engine_tps, "stack_output_tok_per_s": stack_tps,
        "stack_share_of_engine": stack_tps / engine_tps,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'':<8}{'output tok/s':>14}")
    print(f"{'engine':<8}{engine_tps:>14,.0f}")
    print(f"{'stack':<8}{stack_tps:>14,.0f}   {stack_tps / engine_tps:.0%} of the engine")
    cpu = stack_runs[-1]["cpu_us_per_output_token"]
    if any(cpu.values()):
        print("CPU µs per output token (last run): " + ", ".join(
            f"{role} {parts['event_loop']:.0f} event loop / {parts['process']:.0f} process"
            for role, parts in cpu.items() if parts))


if __name__ == "__main__":
    main()

"""Serving one model in one deployment mode, then the same Poisson load on it (`tandem bench serve`).

    python -m tandem.benchmarks.serve_modes --mode colocated --model dummy:llama-3.1-8b --device cuda \\
        --rates 2,8,32 --num-requests 64 --prompt-len fixed:1024 --output-len fixed:256 --out serve-colocated.json

Modes, all on one machine (and one GPU):
- `colocated`: one decode worker that prefills its own prompts (no prefill worker);
- `disagg`: one prefill and one decode worker sharing the GPU as `tandem up` does by default (CUDA MPS, neither
  capped, where MPS is installed; cuda-ipc handoff on a GPU);
- `timeshared`: the same, time-sharing the GPU (`--gpu-split off`);
- `grpc`: `disagg` with the pages going by bytes through gRPC (`--kv-transport grpc`), as between hosts;
- `split:P` or `split:P:D`: under CUDA MPS, P% of the SMs to prefill and the rest (or D%) to decode
  (`tandem up --gpu-split P[:D]`; `split:100:100` is the default's).

Writes the serve benchmark's JSON (TTFT, TPOT, ITL, e2e percentiles, throughput, goodput per rate) with the mode,
the stack's first-request TTFT (cold) against the steady-state median, and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.launcher import free_port


def stack_command(mode: str, model: str, device: str, port: int, http_port: int, status: Path,
                  max_num_seqs: int, num_prefill: int = 1) -> list[str]:
    command = [sys.executable, "-m", "tandem.cli", "up", "--model", model, "--device", device, "--decode", "1",
               "--port", str(port), "--http-port", str(http_port), "--status-file", str(status),
               "--max-num-seqs", str(max_num_seqs)]
    if mode == "colocated":
        return command + ["--prefill", "0"]
    command += ["--prefill", str(num_prefill)]
    if mode == "disagg":
        return command
    if mode == "timeshared":
        return command + ["--gpu-split", "off"]
    if mode == "grpc":
        return command + ["--kv-transport", "grpc"]
    if mode.startswith("split:"):
        return command + ["--gpu-split", mode.removeprefix("split:")]
    raise SystemExit(f"--mode: colocated, disagg, timeshared, grpc or split:P[:D], got {mode!r}")


@contextlib.contextmanager
def running_stack(mode: str, model: str, device: str, max_num_seqs: int, extra_args: list[str],
                  out: Path, num_prefill: int = 1) -> Iterator[tuple[str, float, dict[str, str]]]:
    """`tandem up` in `mode` with `extra_args`, its log beside `out`; yields (gateway address, start-up seconds,
    the workers' KV pools by `kv_pools`) once it is serving, and stops it (SIGTERM) afterwards."""
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    status = Path(tempfile.mkdtemp(prefix="tandem-serve-")) / "status.json"
    log = out.with_suffix(".stack.log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as log_file:
        command = stack_command(mode, model, device, port, http_port, status, max_num_seqs, num_prefill)
        stack = subprocess.Popen(command + extra_args,
                                 stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        started = time.monotonic()
        while not status.exists():
            if stack.poll() is not None:
                raise SystemExit(f"the stack exited with {stack.returncode}; see {log}")
            if time.monotonic() - started > 600:
                raise SystemExit(f"the stack did not start in 600 s; see {log}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", time.monotonic() - started, kv_pools(status)
    finally:
        stack.send_signal(signal.SIGTERM)
        try:
            stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stack.kill()


def kv_pools(status: Path) -> dict[str, str]:
    """Each worker's `KV pool: ...` line from its log (the paths `tandem up --status-file` wrote), by role and
    index: how the GPU's memory went to the roles in this run (and whose weights a prefill worker ran on)."""
    try:
        services = json.loads(status.read_text())["services"]
    except (OSError, ValueError, KeyError):
        return {}
    pools: dict[str, str] = {}
    counts: dict[str, int] = {}
    for service in services:
        role = service.get("role", "?")
        index = counts.get(role, 0)
        counts[role] = index + 1
        try:
            lines = Path(service["log"]).read_text(errors="replace").splitlines()
        except (OSError, KeyError):
            continue
        line = next((ln for ln in lines if "KV pool:" in ln), None)
        if line is not None:
            pools[f"{role}-{index}"] = line[line.index("KV pool:") + len("KV pool:"):].strip()
            # `start_engine`'s line of a prefill worker on a decode worker's weights (tandem up's default on a GPU)
            if any("weight tensors of the worker beside it" in ln for ln in lines):
                pools[f"{role}-{index}"] += " [weights mapped from decode]"
    return pools


def first_request_ttft(address: str, prompt_len: int, repeats: int = 5) -> dict[str, float]:
    """TTFT of the stack's very first request (cold), then the median of a few more (warm), one at a time."""
    import grpc

    from tandem.v1 import generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    times = []
    for i in range(1 + repeats):
        ids = [(17 * i + 3 * j) % 1000 + 10 for j in range(prompt_len)]
        request = generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=ids),
                                                 sampling=generation_pb2.SamplingParams(max_tokens=2, temperature=0))
        start = time.perf_counter()
        for _ in stub.Generate(request, timeout=120):
            times.append(time.perf_counter() - start)
            break
    warm = sorted(times[1:])[len(times[1:]) // 2]
    return {"first_s": times[0], "steady_median_s": warm, "first_over_steady": times[0] / warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rates", default="2,8,32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="fixed:1024")
    parser.add_argument("--output-len", default="fixed:256")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--ttft-slo", type=float, default=0.2)
    parser.add_argument("--tpot-slo", type=float, default=0.05)
    parser.add_argument("--stack-args", default="",
                        help="more `tandem up` flags, e.g. '--no-chunked-prefill' or '--quantization fp8'")
    parser.add_argument("--prefill-workers", type=int, default=1,
                        help="prefill workers of the modes that have them (all on the one GPU)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from tandem.benchmarks.serve import run

    command_args = shlex.split(args.stack_args)
    with running_stack(args.mode, args.model, args.device, args.max_num_seqs, command_args, args.out,
                       args.prefill_workers) as (address, startup_s, pools):
        if pools:
            print("KV pools: " + "; ".join(f"{name}: {line}" for name, line in pools.items()), flush=True)
        prompt_tokens = int(args.prompt_len.split(":")[1])
        cold = first_request_ttft(address, prompt_tokens)
        results = run(address, [float(r) for r in args.rates.split(",")], args.num_requests, args.prompt_len,
                      args.output_len, args.ttft_slo, args.tpot_slo, 0, 600.0, None, None,
                      f"{args.mode} {args.stack_args}".strip())
    report: dict[str, Any] = {
        "benchmark": "serve_modes", "mode": args.mode, "stack_args": command_args, "model": args.model,
        "prefill_workers": 0 if args.mode == "colocated" else args.prefill_workers,
        "device": args.device,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "num_requests": args.num_requests,
        "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo, "stack_startup_s": startup_s,
        "first_request": cold, "kv_pools": pools, "results": results}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.mode}: stack up in {startup_s:.1f} s; first request TTFT {cold['first_s'] * 1e3:.1f} ms, "
          f"steady {cold['steady_median_s'] * 1e3:.1f} ms ({cold['first_over_steady']:.2f}x)")


if __name__ == "__main__":
    main()

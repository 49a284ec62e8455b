"""Where a serving engine's time goes, step by step, at a steady arrival rate (no gRPC, no gateway).

    python -m tandem.benchmarks.step_trace --model dummy:llama-3.1-8b --device cuda --rate 2 \
        --num-requests 64 --prompt-len 1024 --output-len 256 [--no-chunked-prefill]

One engine, warmed up as a worker warms it (`Engine.warm_up`), steps on this thread while requests arrive at
`--rate` per second (Poisson, seeded). Every step is recorded: its wall time, its decode tokens and prompt tokens,
and the Triton kernels compiled during it (Triton's post-compile hook, on a GPU). Reported per request: TTFT
(arrival → the step that sampled its first token) and TPOT; and the steps: how many were decode-only, mixed or
prefill-only, their median times, and every compile with its kernel's name and the step it stalled. A serving
stack's TTFT at low rates is this TTFT plus the transport; where they differ, the difference is the stack's.
JSON out (`--out`), a summary last.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.common.sampling_params import SamplingParams
from tandem.engine.compile_watch import CompileWatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: a served worker's on the device")
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    import triton

    import tandem
    from tandem.benchmarks.serve import percentiles
    from tandem.common.config import default_batched_tokens
    from tandem.engine.llm import LLM  # imports torch: after the arguments are checked
    chunked = not args.no_chunked_prefill
    max_model_len = args.prompt_len + args.output_len + 16
    budget = args.max_num_batched_tokens or default_batched_tokens(args.device, chunked)
    if not chunked:
        budget = max(budget, max_model_len)
    llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
              enable_chunked_prefill=chunked, max_model_len=max_model_len)
    engine = llm.engine
    compiles = CompileWatch()
    engine.warm_up()
    num_warm_up_compiles = compiles.num_startup
    compiles.serving()

    rng = random.Random(args.seed)
    vocab = engine.config.model.vocab_size
    arrivals, t = [], 0.0
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[dict[str, Any]] = []
    start = time.perf_counter()
    next_i = 0
    while len(done) < args.num_requests:
        now = time.perf_counter() - start
        while next_i < len(arrivals) and arrivals[next_i] <= now:
            req_id = f"r{next_i}"
            engine.add_request(req_id, [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
            sent[req_id] = start + arrivals[next_i]
            next_i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[next_i] - now))
            continue
        step_start = time.perf_counter()
        result = engine.step()
        step_end = time.perf_counter()
        num_decode = sum(1 for r, n in zip(result.requests, result.num_new_tokens, strict=False)
                         if n == 1 and r.num_output_tokens > 1)
        num_prompt = sum(result.num_new_tokens) - num_decode
        steps.append({"t": round(step_start - start, 4), "ms": round((step_end - step_start) * 1e3, 3),
                      "decode": num_decode, "prompt_tokens": num_prompt, "compiles": compiles.take()})
        for request in result.requests:
            if request.req_id not in first and request.num_output_tokens > 0:
                first[request.req_id] = step_end
        for request in result.finished:
            done[request.req_id] = step_end

    ttft = [(first[r] - sent[r]) * 1e3 for r in sent]
    tpot = [(done[r] - first[r]) * 1e3 / max(1, args.output_len - 1) for r in sent]
    kinds: dict[str, list[float]] = {"decode": [], "mixed": [], "prompt": []}
    for s in steps:
        kind = "prompt" if s["decode"] == 0 else ("mixed" if s["prompt_tokens"] else "decode")
        kinds[kind].append(s["ms"])
    compiled = [(s["t"], name) for s in steps for name in s["compiles"]]
    summary: dict[str, Any] = {
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "steps": {k: {"count": len(v), "median_ms": statistics.median(v) if v else None} for k, v in kinds.items()},
        "compiles_at_warm_up": num_warm_up_compiles, "compiles_while_serving": len(compiled),
        "compiled_kernels_while_serving": sorted(set(name for _, name in compiled)),
    }
    versions = {"tandem": tandem.__version__, "torch": torch.__version__, "triton": triton.__version__}
    report = {"benchmark": "step_trace", "args": vars(args) | {"out": str(args.out)}, "versions": versions,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "summary": summary,
              "ttft_ms_by_arrival": [round(x, 2) for x in ttft], "steps": steps}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    mode = f"chunked ({budget} tokens a step)" if chunked else "whole"
    print(f"{mode} at {args.rate} req/s: TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, p99 "
          f"{summary['ttft_ms']['p99']:.1f} ms; TPOT p50 {summary['tpot_ms']['p50']:.2f} ms")
    for kind, row in summary["steps"].items():
        if row["count"]:
            print(f"  {kind:7s} steps {row['count']:5d}  median {row['median_ms']:.2f} ms")
    print(f"  Triton compiles: {num_warm_up_compiles} at warm-up, {len(compiled)} while serving "
          f"{summary['compiled_kernels_while_serving']}")
    for t, name in compiled[:20]:
        print(f"    t={t:.2f} s  {name}")


if __name__ == "__main__":
    main()

"""What one engine step costs by shape, and whether the host or the GPU sets it.

    python -m tandem.benchmarks.step_cost --model dummy:llama-3.1-8b --device cuda \
        --prompt-tokens 128,256,512,1024,2048 --decodes 0,16 [--profile]

For every (prompt tokens P, decoding sequences D): D requests decode while one new request's P prompt tokens are
computed in the same step (P = 0: a pure decode step). Reported per shape, medians of `--repeat` steps:

  wall_ms     the step, from `Engine.step()` to its sampled tokens on the host
  enqueue_ms  the forward's host time, inputs included (until the runner's logits call returns, kernels still
              queued): eager launches, or piecewise/decode graph replays
  gpu_ms      the forward's GPU time (CUDA events around that call)
  schedule_ms, prepare_ms, update_ms
              the engine's bookkeeping on the host: `Scheduler.schedule`, a pure decode step's inputs
              (`prepare_decode`; a mixed step's are in enqueue_ms) and `Scheduler.update_from_output`

`enqueue_ms` close to `gpu_ms` means the host launches kernels no faster than the GPU runs them: the step is
host-bound, and CUDA graphs (or fewer launches) are what shortens it. With `--profile`, the GPU kernels of one step
of each shape, by total time (torch.profiler). JSON out (`--out`), a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.common.sampling_params import SamplingParams


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=_ints, default=_ints("0,128,512,1024"))
    parser.add_argument("--decodes", type=_ints, default=_ints("0,16"))
    parser.add_argument("--context", type=int, default=1024, help="the decoding sequences' prompt length")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="kernel times of one step per shape")
    parser.add_argument("--quantization", choices=["int8", "fp8"], help="the weights' (default: the model's dtype)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    import tandem
    from tandem.engine.llm import LLM

    max_p = max(args.prompt_tokens)
    max_d = max(args.decodes)
    steps_needed = (args.repeat + 2) * len(args.prompt_tokens) * (2 if args.profile else 1) + 8
    max_model_len = max(max_p, args.context) + steps_needed + 64
    started = time.perf_counter()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(max_d, 1) + 1,
              # The decoding sequences' prompts go in steps of at most 16,384 tokens (an 8B model's activations for
              # 256 x 1,024 in one step would not fit beside its pool).
              max_num_batched_tokens=max(max_p + max_d, min(args.context * max(max_d, 1), 16384), 16),
              max_model_len=max_model_len, prompt_tokens_while_decoding=0,  # the shapes as asked
              async_scheduling=False,  # one step at a time: its parts and its GPU time are its own
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    runner = engine.runner
    engine.warm_up()
    startup_s = time.perf_counter() - started  # weights, KV pool, graph captures, warm-up compiles
    cuda = runner.device.type == "cuda"
    vocab = engine.config.model.vocab_size
    timing: dict[str, Any] = {}
    originals = {name: getattr(runner, name) for name in ("chunk_logits", "decode_logits")}

    def timed(fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            t0 = time.perf_counter()
            logits = fn(*a, **kw)
            timing["enqueue"] = time.perf_counter() - t0
            if cuda:
                end.record()
                timing["events"] = (begin, end)
            return logits
        return call

    for name, fn in originals.items():
        setattr(runner, name, timed(fn))
    # The engine's own bookkeeping on the host (the GPU idles through it in a pure decode step): schedule, the decode
    # inputs, the update with the sampled tokens.
    bookkeeping = {"schedule": (engine.scheduler, "schedule"), "prepare": (runner, "prepare_decode"),
                   "update": (engine.scheduler, "update_from_output")}
    bookkeeping_originals = {key: getattr(obj, name) for key, (obj, name) in bookkeeping.items()}

    def host_timed(key: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            timing[key] = time.perf_counter() - t0
            return result
        return call

    for key, (obj, name) in bookkeeping.items():
        setattr(obj, name, host_timed(key, bookkeeping_originals[key]))
    rows: list[dict[str, Any]] = []
    counter = 0
    for num_decode in args.decodes:
        # D long-running requests, past their prompts.
        for i in range(num_decode):
            engine.add_request(f"d{num_decode}-{i}", [(7 * i + j) % vocab for j in range(args.context)],
                               SamplingParams(max_tokens=max_model_len - args.context - 1, temperature=0.0,
                                              ignore_eos=True))
        while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for num_prompt in args.prompt_tokens:
            if num_prompt == 0 and num_decode == 0:
                continue
            samples: dict[str, list[float]] = {"wall": [], "enqueue": [], "gpu": [], "schedule": [], "prepare": [],
                                               "update": []}
            profile: list[dict[str, Any]] = []
            for rep in range(args.repeat + 1 + int(args.profile)):
                if num_prompt:
                    counter += 1
                    engine.add_request(f"p{counter}", [(11 * counter + j) % vocab for j in range(num_prompt)],
                                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                profiling = args.profile and rep == args.repeat + 1
                if cuda:
                    torch.cuda.synchronize()
                prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                        if profiling and cuda else None)
                if prof is not None:
                    prof.__enter__()
                timing["prepare"] = 0.0  # a mixed step prepares its inputs in `chunk_logits` (in enqueue)
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                if prof is not None:
                    torch.cuda.synchronize()
                    prof.__exit__(None, None, None)
                    kernels = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
                    profile = [{"name": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 3)}
                               for e in kernels[:15]]
                if rep == 0 or profiling:
                    continue  # the first step of a shape settles allocations
                samples["wall"].append(wall)
                samples["enqueue"].append(timing["enqueue"])
                for key in bookkeeping:
                    samples[key].append(timing[key])
                if cuda:
                    begin, end = timing["events"]
                    samples["gpu"].append(begin.elapsed_time(end) / 1e3)
            row: dict[str, Any] = {"prompt_tokens": num_prompt, "decodes": num_decode}
            for key, values in samples.items():
                row[f"{key}_ms"] = round(statistics.median(values) * 1e3, 3) if values else None
            if profile:
                row["kernels"] = profile
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        for i in range(num_decode):
            engine.abort(f"d{num_decode}-{i}")
        while engine.has_unfinished():
            engine.step()
    for name, fn in originals.items():
        setattr(runner, name, fn)
    for key, (obj, name) in bookkeeping.items():
        setattr(obj, name, bookkeeping_originals[key])

    graph_buckets = {kind: {"times_ms": {k: round(v, 3) for k, v in g.bucket.times_ms.items()}, "route": g.bucket.route}
                     for kind, g in (("decode", runner.graphs), ("piecewise", runner.mixed_graphs)) if g is not None}
    report = {"benchmark": "step_cost", "args": vars(args) | {"out": str(args.out)},
              "versions": {"tandem": tandem.__version__, "torch": torch.__version__},
              "gpu": torch.cuda.get_device_name() if cuda else None,
              "piecewise_graphs": runner.mixed_graphs is not None, "startup_s": round(startup_s, 2),
              "graph_buckets": graph_buckets,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"piecewise graphs: {'on' if runner.mixed_graphs is not None else 'off'}; engine up in {startup_s:.1f} s")
    for kind, buckets in graph_buckets.items():
        moved = {size: to for size, to in buckets["route"].items() if to != size}
        print(f"{kind} graphs' buckets (ms): {buckets['times_ms']}; replayed larger: {moved or 'none'}")
    print(f"{'prompt':>7s} {'decodes':>7s} {'wall ms':>8s} {'enqueue ms':>10s} {'gpu ms':>7s}  "
          f"{'schedule':>8s} {'prepare':>8s} {'update':>8s}")
    for r in rows:
        gpu = f"{r['gpu_ms']:7.2f}" if r["gpu_ms"] is not None else "      -"
        print(f"{r['prompt_tokens']:7d} {r['decodes']:7d} {r['wall_ms']:8.2f} {r['enqueue_ms']:10.2f} {gpu}  "
              f"{r['schedule_ms']:8.3f} {r['prepare_ms']:8.3f} {r['update_ms']:8.3f}")
        for k in r.get("kernels", [])[:6]:
            print(f"        {k['ms']:8.3f} ms  {k['calls']:4d}x  {k['name']}")


if __name__ == "__main__":
    main()

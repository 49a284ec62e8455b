"""Serving at given rates through the real scheduler with the GPU replaced by measured step costs.

    python -m tandem.benchmarks.sched_sim --cost benchmarks/results/h200-2026-12-02/step-cost-8b-piecewise.json \
        --rates 2,8,16,32,48 [--prompt-tokens-while-decoding N] [--max-num-batched-tokens N]

Poisson arrivals of fixed-length prompts go through `tandem.engine.scheduler.Scheduler` exactly as a colocated
decode worker schedules them (chunked prefill, token budget, prompt cap, block pool); each step takes the time a
GPU took for a step of the same shape (prompt tokens P, decoding requests D): bilinear in the `step_cost` table
(`--cost`, wall ms by P and D; a mixed step with fewer decodes than the table's first decode row costs that row),
linear past its last decode row with `--decode-slope-ms` per extra decoding request,
plus `--overhead-ms` per step for the serving process (the stack's steps are slower than the engine's alone). A
token's time is its step's end. Reported per rate as `benchmarks/serve.py` reports a run: TTFT, TPOT, ITL
percentiles and goodput (TTFT <= 200 ms and TPOT <= 50 ms).

What it is for: comparing scheduling policies (the token budget, the prompt cap) at rates a GPU session would take
minutes to cover, once the model is checked against a measured serve run (the defaults reproduce the H200's
colocated run of 2026-12-02: see benchmarks/results/README.md). It models no prefix caching, no preemption
cost and no gateway.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.common.config import SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import scheduler as scheduler_module
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler

BLOCK_SIZE = 16


class StepCost:
    """Wall ms of a step with P prompt tokens and D decoding requests, from a `step_cost` table."""

    def __init__(self, rows: list[dict[str, Any]], decode_slope_ms: float) -> None:
        table: dict[int, dict[int, float]] = {}
        for row in rows:
            table.setdefault(row["decodes"], {})[row["prompt_tokens"]] = row["wall_ms"]
        self.decodes = sorted(table)
        self.prompts = sorted({p for by_p in table.values() for p in by_p if p > 0})
        if 0 in table and 0 not in table[0]:
            # No work at all has no cost; extrapolate decode-only rows to D = 0 for the P = 0 column.
            d1, d2 = [d for d in self.decodes if d > 0][:2]
            table[0][0] = table[d1][0] - d1 * (table[d2][0] - table[d1][0]) / (d2 - d1)
        self.table = table
        self.decode_slope_ms = decode_slope_ms

    def _by_prompt(self, decodes: int, prompt: int) -> float:
        by_p = self.table[decodes]
        ps = sorted(by_p)
        if prompt >= ps[-1]:  # linear past the last measured prompt size
            slope = (by_p[ps[-1]] - by_p[ps[-2]]) / (ps[-1] - ps[-2])
            return by_p[ps[-1]] + (prompt - ps[-1]) * slope
        i = bisect.bisect_right(ps, prompt)
        lo, hi = ps[i - 1], ps[i]
        return by_p[lo] + (prompt - lo) * (by_p[hi] - by_p[lo]) / (hi - lo)

    def ms(self, prompt: int, decodes: int) -> float:
        ds = self.decodes
        first = next(d for d in ds if d > 0)
        if prompt and 0 < decodes < first:
            # Beside prompt tokens, decode tokens cost their attention's fixed share at once (the H200's serving
            # steps of 512 prompt tokens and 1-3 decodes took 15.8-16.9 ms, the table's 16 decodes 16.4).
            decodes = first
        if decodes >= ds[-1]:
            return self._by_prompt(ds[-1], prompt) + (decodes - ds[-1]) * self.decode_slope_ms
        i = bisect.bisect_right(ds, decodes)
        lo, hi = ds[i - 1], ds[i]
        a, b = self._by_prompt(lo, prompt), self._by_prompt(hi, prompt)
        return a + (decodes - lo) * (b - a) / (hi - lo)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"p50": statistics.median(ordered), "p90": at(0.90), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def simulate(cost: Callable[[int, int], float], rate: float, num_requests: int, prompt_len: int, output_len: int,
             config: SchedulerConfig, overhead_ms: float, seed: int, vocab: int = 32000,
             step_sizes: tuple[int, ...] = (), cap_max_wait_s: float = 0.0, cap_lift: int = 0) -> dict[str, Any]:
    """One serve run at `rate` req/s; times in seconds of simulated clock. `step_sizes`: the GPU runner's sizes
    without padding (the scheduler trims chunks to them); `cap_max_wait_s`: the scheduler's experiment of that name."""
    rng = random.Random(seed)
    scheduler = Scheduler(config, BlockPool(num_requests * -(-(prompt_len + output_len) // BLOCK_SIZE) + 1),
                          BLOCK_SIZE, ())
    scheduler.step_sizes = step_sizes
    scheduler.cap_max_wait_s = cap_max_wait_s
    scheduler.cap_lift = cap_lift
    clock = 0.0
    scheduler.clock = lambda: clock
    arrivals: list[float] = []
    t = 0.0
    for _ in range(num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    requests = [Request(req_id=f"r{i}", prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                        params=params, seed=0, arrival_time=arrivals[i]) for i in range(num_requests)]
    token_times: list[list[float]] = [[] for _ in range(num_requests)]
    index = {r.req_id: i for i, r in enumerate(requests)}
    next_arrival, done, steps = 0, 0, 0
    while done < num_requests:
        while next_arrival < num_requests and arrivals[next_arrival] <= clock:
            scheduler.add(requests[next_arrival])
            next_arrival += 1
        output = scheduler.schedule()
        if output is None or not output.requests:
            if next_arrival == num_requests:
                raise RuntimeError("requests are left that the scheduler cannot run (a pool or budget too small)")
            clock = arrivals[next_arrival]  # idle until the next arrival
            continue
        num_prompt = sum(n for r, n in zip(output.requests, output.num_new_tokens, strict=True) if r.is_prefilling)
        num_decode = len(output.requests) - sum(1 for r in output.requests if r.is_prefilling)
        clock += (cost(num_prompt, num_decode) + overhead_ms) / 1e3
        steps += 1
        num_sampling = sum(output.samples(i) for i in range(len(output.requests)))
        before = [r.num_output_tokens for r in output.requests]
        finished = scheduler.update_from_output(output, [5] * num_sampling, [0.0] * num_sampling)
        for request, count in zip(output.requests, before, strict=True):
            if request.num_output_tokens > count:
                token_times[index[request.req_id]].append(clock)
        done += len(finished)
    ttft = [times[0] - arrivals[i] for i, times in enumerate(token_times)]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times if len(times) > 1]
    itl = [b - a for times in token_times for a, b in zip(times, times[1:], strict=False)]
    duration = max(times[-1] for times in token_times)
    good = sum(1 for f, p in zip(ttft, tpot, strict=True) if f <= 0.2 and p <= 0.05)
    return {"rate": rate, "num_requests": num_requests, "steps": steps, "duration_s": duration,
            "output_tok_per_s": num_requests * output_len / duration, "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot), "itl_s": percentiles(itl), "goodput_rps": good / duration}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost", type=Path, required=True, help="a step_cost JSON (wall ms by shape)")
    parser.add_argument("--rates", default="2,8,16,32,48")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prompt-tokens-while-decoding", type=int, default=0)
    parser.add_argument("--decode-slope-ms", type=float, default=0.053,
                        help="ms per decoding request past the table's last decode row (8B at 1,024 context: "
                             "8.67 ms at 64, 18.90 at 256 on the H200)")
    parser.add_argument("--overhead-ms", type=float, default=1.0, help="serving overhead per step")
    parser.add_argument("--backlog-steps", type=int, default=None,
                        help="with a cap: capped steps' worth of waiting prompt tokens past which a step takes the "
                             "whole budget (default: the scheduler's BACKLOG_STEPS)")
    parser.add_argument("--step-sizes", default="",
                        help="token counts a step runs without padding (comma-separated; the GPU runner's graph "
                             "buckets that replay themselves): chunks are trimmed to them as on the GPU")
    parser.add_argument("--cap-max-wait-ms", type=float, default=0.0,
                        help="with a cap: lift it once a prompt has waited this long (0: off)")
    parser.add_argument("--cap-lift", type=int, default=0,
                        help="with a cap: the prompt tokens a lifted cap allows (0: the whole budget)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per rate (medians reported)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    if args.backlog_steps is not None:
        scheduler_module.BACKLOG_STEPS = args.backlog_steps  # an experiment's knob, not a served setting
    args.backlog_steps = scheduler_module.BACKLOG_STEPS
    cost = StepCost(json.loads(args.cost.read_text())["rows"], args.decode_slope_ms)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_chunked_prefill=True,
                             prompt_tokens_while_decoding=args.prompt_tokens_while_decoding)
    results = []
    for rate in (float(r) for r in args.rates.split(",")):
        step_sizes = tuple(int(x) for x in args.step_sizes.split(",") if x)
        runs = [simulate(cost.ms, rate, args.num_requests, args.prompt_len, args.output_len, config,
                         args.overhead_ms, seed, step_sizes=step_sizes, cap_max_wait_s=args.cap_max_wait_ms / 1e3,
                         cap_lift=args.cap_lift)
                for seed in range(args.seeds)]

        def med(key: str, q: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key][q] for r in runs)
        results.append({"rate": rate, "runs": runs, "ttft_p50_ms": med("ttft_s", "p50") * 1e3,
                        "ttft_p99_ms": med("ttft_s", "p99") * 1e3, "tpot_p50_ms": med("tpot_s", "p50") * 1e3,
                        "itl_p99_ms": med("itl_s", "p99") * 1e3,
                        "goodput_rps": statistics.median(r["goodput_rps"] for r in runs)})
    report = {"benchmark": "sched_sim", "label": args.label, "args": vars(args) | {"cost": str(args.cost),
              "out": str(args.out)}, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"budget {args.max_num_batched_tokens}, prompt cap {args.prompt_tokens_while_decoding or 'off'} (lifted past "
          f"{args.backlog_steps} capped steps of backlog; median of {args.seeds} runs)")
    print(f"{'rate':>6s} {'TTFT p50':>9s} {'p99':>8s} {'TPOT p50':>9s} {'ITL p99':>8s} {'ITL/TPOT':>8s} "
          f"{'goodput':>8s}")
    for r in results:
        print(f"{r['rate']:6.1f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:8.1f} {r['tpot_p50_ms']:9.2f} "
              f"{r['itl_p99_ms']:8.1f} {r['itl_p99_ms'] / r['tpot_p50_ms']:8.2f} {r['goodput_rps']:8.2f}")


if __name__ == "__main__":
    main()

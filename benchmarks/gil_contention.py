"""A prefill step while another thread of the process runs Python, by GIL switch interval.

    python -m tandem.benchmarks.gil_contention --model dummy:llama-3.2-1b --device cuda --batch 32 --prompt-len 256 \\
        --intervals 0.005,0.0005,0.0001,0.00005,0.00002 --out gil-contention.json

A worker's engine thread shares the GIL with its event loop. Every torch op and every Triton launch releases the GIL
around its C++ part; when the other thread is waiting for it, it takes the GIL then, and the engine thread gets it
back only when the holder reaches a switch (after the interval, Python's 5 ms by default). A step's host work is
hundreds of such calls, so while the event loop is busy (a burst of requests arriving, say) each of them can cost
up to one interval. Here one engine runs the same prefill step alone and with a `busy` thread (protobuf parsing and
Python bookkeeping, what an RPC handler does) at each interval, interleaved; median of `--repeat` each. The busy
thread's rate says what the interval costs the event loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem.common.config import EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.models import load_model_config
from tandem.v1 import worker_pb2


class Busy:
    """A thread doing what an event loop does for a burst of RPCs: parse a request, touch a few dicts, repeat."""

    def __init__(self, prompt_len: int) -> None:
        request = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=list(range(prompt_len)))
        self._data = request.SerializeToString()
        self._stop = threading.Event()
        self.count = 0
        self._thread = threading.Thread(target=self._run, name="busy", daemon=True)

    def _run(self) -> None:
        state: dict[str, Any] = {}
        while not self._stop.is_set():
            request = worker_pb2.PrefillRequest.FromString(self._data)
            prompt = list(request.prompt_token_ids)
            state[f"r{self.count % 256}"] = {"len": len(prompt), "first": prompt[0] if prompt else None}
            self.count += 1

    def __enter__(self) -> Busy:
        self._thread.start()
        time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def step_once(engine: Engine, prompts: list[list[int]], tag: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params, prefill_only=True)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = engine.step()  # ends with the first tokens' host sync
    seconds = time.perf_counter() - start
    assert sum(result.num_new_tokens) == sum(map(len, prompts)), "the batch must fit one step"
    for i in range(len(prompts)):
        engine.release(f"{tag}-{i}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--intervals", default="0.005,0.0005,0.0001,0.00005,0.00002",
                        help="GIL switch intervals (s), comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    intervals = [float(v) for v in args.intervals.split(",")]
    tokens = args.batch * args.prompt_len
    config = EngineConfig.create(load_model_config(args.model), device=args.device,
                                 num_kv_blocks=2 * (tokens // 16 + args.batch) + 16,
                                 max_model_len=args.prompt_len + 16, max_num_batched_tokens=tokens,
                                 enable_prefix_caching=False)  # the same prompts every time: computed every time
    engine = Engine(config)
    engine.warm_up()
    vocab = config.model.vocab_size
    prompts = [[(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)] for i in range(args.batch)]
    step_once(engine, prompts, "warm")
    alone: dict[float, list[float]] = {v: [] for v in intervals}
    busy: dict[float, list[float]] = {v: [] for v in intervals}
    rates: dict[float, list[float]] = {v: [] for v in intervals}
    for repeat in range(args.repeat):
        for interval in intervals[repeat % len(intervals):] + intervals[:repeat % len(intervals)]:
            sys.setswitchinterval(interval)
            time.sleep(0.1)
            alone[interval].append(step_once(engine, prompts, "alone"))
            with Busy(args.prompt_len) as thread:
                start, count = time.perf_counter(), thread.count
                busy[interval].append(step_once(engine, prompts, "busy"))
                rates[interval].append((thread.count - count) / (time.perf_counter() - start))
    sys.setswitchinterval(0.005)
    rows: list[dict[str, Any]] = [
        {"switch_interval_s": v, "alone_s": statistics.median(alone[v]), "busy_s": statistics.median(busy[v]),
         "busy_over_alone": statistics.median(busy[v]) / statistics.median(alone[v]),
         "busy_thread_per_s": statistics.median(rates[v]), "all_alone_s": alone[v], "all_busy_s": busy[v]}
        for v in intervals]
    report = {"benchmark": "gil_contention", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "model": args.model, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "",
              "versions": {"tandem": tandem.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
              "batch": args.batch, "prompt_len": args.prompt_len, "repeat": args.repeat, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.model}, a prefill step of {args.batch} x {args.prompt_len} tokens, median of {args.repeat}")
    print(f"{'interval ms':>11} {'alone ms':>9} {'busy ms':>8} {'busy/alone':>11} {'busy thread /s':>15}")
    for r in rows:
        print(f"{r['switch_interval_s'] * 1e3:>11.3f} {r['alone_s'] * 1e3:>9.2f} {r['busy_s'] * 1e3:>8.2f} "
              f"{r['busy_over_alone']:>11.2f} {r['busy_thread_per_s']:>15,.0f}")


if __name__ == "__main__":
    main()

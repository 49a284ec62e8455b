"""What a prefill worker's forward costs against a local prefill of the same prompts, in one process.

    python -m tandem.benchmarks.prefill_forward --model dummy:llama-3.1-8b --device cuda --prompt-len 1024 \\
        --batches 1,4 --repeat 8 --out prefill-forward.json

The same prompts are prefilled three ways by one engine, interleaved (each repeat starting with the next mode, every
step after the same idle pause), median of `--repeat` steps each:
- `local`: what a colocated worker does (store the K/V in its own pool);
- `mirror`: the cuda-ipc path on one GPU: every layer also stores its K/V into a second pool (the receiver's
  pages); nothing is copied afterwards;
- `grpc`: every layer hands the step's pages to the `PageExporter` (gather + device→host copy on a side stream,
  serialized messages written on its thread), and each message is copied once more holding the GIL, as gRPC
  copies it into its send buffer; `grpc_export_done` is the time until the last of them is made.
Targets (issue #14): mirror ≤ 1.05× local, grpc ≤ 1.15× local. A step's time includes sampling the first token
(its host sync ends the step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem.common.config import EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.request import KVMirror
from tandem.models import load_model_config
from tandem.serving.kv_transfer import EXPORT_SWITCH_INTERVAL_S, PageExporter, WirePages


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engine: Engine, prompts: list[list[int]], mode: str, mirror_layers: list[Any],
            exporter: PageExporter, counter: list[int]) -> tuple[float, float]:
    """One prefill step of `prompts` in `mode`: (step seconds, seconds until the pages are out)."""
    device = engine.runner.device
    params = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
    block_size = engine.config.cache.block_size
    engine.on_prefill_step = None
    if mode == "grpc":
        def on_step(chunks: list[Any]) -> Any:
            return exporter.begin_step([(r.req_id, 0, list(r.block_ids)) for r, _, _ in chunks], sent)

        def sent(req_id: str, messages: list[WirePages]) -> None:
            for message in messages:  # what gRPC's send does with the GIL held: copy the message into a slice
                counter.append(len(bytearray(message.data)))
        engine.on_prefill_step = on_step  # type: ignore[assignment]
    next_block = 0
    for i, prompt in enumerate(prompts):
        mirror = None
        if mode == "mirror":
            num_blocks = -(-len(prompt) // block_size)
            mirror = KVMirror(mirror_layers, list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        engine.add_request(f"{mode}-{i}", prompt, params, prefill_only=True, kv_mirror=mirror)
    _sync(device)
    start = time.perf_counter()
    result = engine.step()
    step_s = time.perf_counter() - start
    assert len(result.requests) == len(prompts), "the batch must fit one step"
    assert sum(result.num_new_tokens) == sum(map(len, prompts)), "every prompt token must be computed"
    if mode == "grpc":
        exporter.flush().result(timeout=120)
    done_s = time.perf_counter() - start
    for i in range(len(prompts)):
        engine.release(f"{mode}-{i}")
    return step_s, done_s


def profile_step(engine: Engine, prompts: list[list[int]], mode: str, mirror_layers: list[Any],
                 exporter: PageExporter, counter: list[int], top: int = 12) -> dict[str, Any]:
    """One step of `mode` under torch's profiler: the kernels (or CPU ops) that took the most device time, and the
    total, to say where one mode's step differs from another's."""
    cuda = engine.runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step_s, _ = measure(engine, prompts, mode, mirror_layers, exporter, counter)
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if key(e) > 0), key=key, reverse=True)
    return {"step_s": step_s, "total_self_us": sum(key(e) for e in events), "unit": "device" if cuda else "cpu",
            "top": [{"name": e.key[:120], "count": e.count, "self_us": key(e)} for e in events[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settle-s", type=float, default=0.3, help="idle pause before every measured step")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step per mode at the largest batch: kernels by device time")
    parser.add_argument("--switch-interval", type=float, default=EXPORT_SWITCH_INTERVAL_S,
                        help="GIL switch interval (s), as the prefill worker sets it; Python's default is 0.005")
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval)

    batches = [int(b) for b in args.batches.split(",")]
    max_len = max(args.prompt_len + 16, 64)
    config = EngineConfig.create(load_model_config(args.model), device=args.device, num_kv_blocks=args.num_kv_blocks,
                                 max_model_len=max_len, max_num_batched_tokens=max(batches) * max_len,
                                 # The same prompts again and again: a prefix cache would compute one token of each.
                                 enable_prefix_caching=False)
    engine = Engine(config)
    engine.warm_up()
    peer = torch.zeros_like(engine.runner.kv_cache.tensor)
    mirror_layers = [(peer[i, 0], peer[i, 1]) for i in range(peer.shape[0])]
    exporter = PageExporter(engine.runner.kv_cache.tensor)
    counter: list[int] = []
    vocab = config.model.vocab_size
    rows: list[dict[str, Any]] = []
    for batch in batches:
        prompts = [[(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)] for i in range(batch)]
        times: dict[str, list[tuple[float, float]]] = {"local": [], "mirror": [], "grpc": []}
        for mode in times:  # warm-up of each path at this shape
            measure(engine, prompts, mode, mirror_layers, exporter, counter)
        modes = list(times)
        for repeat in range(args.repeat):
            # Each repeat starts with another mode, after the same pause: a step that follows another one at once
            # runs on a GPU that is hotter (its clocks lower) than one after an idle moment.
            for mode in modes[repeat % len(modes):] + modes[:repeat % len(modes)]:
                time.sleep(args.settle_s)
                times[mode].append(measure(engine, prompts, mode, mirror_layers, exporter, counter))
        med = {mode: statistics.median(s for s, _ in values) for mode, values in times.items()}
        row = {"batch": batch, "prompt_len": args.prompt_len,
               "local_s": med["local"], "mirror_s": med["mirror"], "grpc_s": med["grpc"],
               "grpc_export_done_s": statistics.median(d for _, d in times["grpc"]),
               "mirror_over_local": med["mirror"] / med["local"], "grpc_over_local": med["grpc"] / med["local"],
               "all_s": {mode: [s for s, _ in values] for mode, values in times.items()}}
        if args.profile and batch == max(batches):
            row["profile"] = {mode: profile_step(engine, prompts, mode, mirror_layers, exporter, counter)
                              for mode in times}
        rows.append(row)
    exporter.close()
    report = {"benchmark": "prefill_forward", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "",
              "versions": {"tandem": tandem.__version__, "torch": torch.__version__},
              "repeat": args.repeat, "settle_s": args.settle_s, "switch_interval_s": args.switch_interval,
              "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'batch':>5} {'local ms':>9} {'mirror ms':>10} {'grpc ms':>8} {'export done':>12} {'mirror/local':>13} "
          f"{'grpc/local':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['local_s'] * 1e3:>9.2f} {r['mirror_s'] * 1e3:>10.2f} {r['grpc_s'] * 1e3:>8.2f} "
              f"{r['grpc_export_done_s'] * 1e3:>12.2f} {r['mirror_over_local']:>13.3f} {r['grpc_over_local']:>11.3f}")
    for r in rows:
        for mode, prof in r.get("profile", {}).items():
            print(f"batch {r['batch']} {mode}: {prof['total_self_us'] / 1e3:.2f} ms of {prof['unit']} time in the "
                  f"profiled step ({prof['step_s'] * 1e3:.2f} ms); most:")
            for e in prof["top"][:6]:
                print(f"  {e['self_us'] / 1e3:8.2f} ms  x{e['count']:<5} {e['name'][:90]}")


if __name__ == "__main__":
    main()

"""Greedy sampling's reductions over the vocabulary: the fused Triton kernel against torch's `max` + `logsumexp`
(what the sampler ran before), logits [S, V] float32, Llama-3's vocabulary.

    python -m tandem.benchmarks.sample_cost --out sample-cost.json                 (CUDA GPU)
    TRITON_INTERPRET=1 python -m tandem.benchmarks.sample_cost --dry-run --out /tmp/sample-cost.json   (CPU)

Each timed eagerly, as the sampler runs, with CUDA events: the median of --iters runs after warm-up; the two must
agree (the same tokens, logprobs within 1e-5). Reports µs per call and the fraction of the HBM floor (the logits'
bytes at the card's device-to-device copy bandwidth, measured first).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.gpu_engine import environment
from tandem.kernels.greedy_sample import greedy_sample_ref, greedy_sample_triton


def _time_us(fn: Callable[[], Any], iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), the median of 10."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _time_us(functools.partial(dst.copy_, src), 10, 2, True) / 1e6
    return 2 * src.numel() * 4 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU (Triton's interpreter), a small vocabulary")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    cuda = not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    vocab, iters = (args.vocab, args.iters) if cuda else (5000, 3)
    bandwidth = _copy_bandwidth(device) if cuda else 1e12
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, vocab, device=device) * 3
        ids, logprobs, _ = greedy_sample_triton(logits)
        ref_ids, ref_logprobs, _ = greedy_sample_ref(logits)
        if not torch.equal(ids, ref_ids) or not torch.allclose(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5):
            raise SystemExit(f"batch {batch}: the kernel disagrees with torch")
        floor_us = batch * vocab * 4 / bandwidth * 1e6
        row = {"batch": batch, "vocab": vocab, "floor_us": round(floor_us, 2)}
        for name, fn in (("triton", greedy_sample_triton), ("torch", greedy_sample_ref)):
            us = _time_us(functools.partial(fn, logits), iters, max(iters // 10, 1), cuda)
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_fraction_of_floor"] = round(floor_us / us, 3)
        rows.append(row)
        print(f"batch {batch:>4}: triton {row['triton_us']:>8.1f} us, torch {row['torch_us']:>8.1f} us, "
              f"floor {floor_us:.1f} us", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "sample_cost", "environment": environment(),
                                    "copy_bandwidth_tb_per_s": round(bandwidth / 1e12, 3),
                                    "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

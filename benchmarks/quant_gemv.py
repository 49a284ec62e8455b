"""Small-M quantized linears (decode): the old GEMM path against the small-M weight-only kernel, int8 and fp8
weights, Llama-3.1-8B projections, M = 1 / 4 / 16; GB/s against the H200's 4.25 TB/s.

    python -m tandem.benchmarks.quant_gemv --out benchmarks/results/quant-gemv-h200.json        (CUDA GPU)
    python -m tandem.benchmarks.quant_gemv --sweep --out /tmp/quant-gemv-sweep.json              (+ config sweep)
    python -m tandem.benchmarks.quant_gemv --dry-run --out /tmp/quant-gemv-dry.json              (CPU interpreter)

Implementations per (kind, projection, M), all in one process (the switches are arguments here, not the
environment): `bf16` (cuBLAS, F.linear on the bf16 weight: twice the bytes), `old` (the GEMM path:
`int8_launch_config` / W8A8 `fp8_launch_config` with its per-token activation quantization), `new` (the small-M
kernel with `small_m_launch_config`'s defaults), `new-fma` / `new-dot` (its CUDA-core / tensor-core variant
forced), `new-2kernel` (its split-K partials summed by a second kernel instead of the fused last-program reduce);
for int8 also `old-bits`, `new-bits`, `new-dot-bits` (the weight converted to float by integer ops, not I2F:
`quant_common.int8_to_float32`); with --sweep also `new-{fma,dot}-pps{1,2,4,8}` (split-K targets of 1-8 programs
per SM).

Timing, like a decode step: one CUDA graph replays the linear over R distinct copies of the weight (R * weight
bytes >= --stream-mb, default 512 MB, so every call reads its weight from HBM, never from the 60 MB L2), back to
back as a model's layers run; time per call = graph time / R, median of --iters replays. bytes = weight codes +
scales (+ x and out); GB/s = bytes / time; `frac_peak` = GB/s / 4,250. `rel_err` compares each output with the
float64 product of x and the dequantized weight (W8A8 fp8 adds its activation rounding, ~2-3%). The dry run takes
the same code on the CPU with tiny shapes, the kernels in Triton's interpreter, wall-clock timing, no graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

PEAK_GBPS = 4250.0  # H200 device-to-device copy, measured (PERFORMANCE.md)
# Llama-3.1-8B projections: name -> (N, K).
PROJECTIONS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
PROJECTIONS_DRY = {"qkv": (96, 64), "o": (64, 64), "gate_up": (224, 64), "down": (64, 112)}
KINDS = ("int8", "fp8")


def make_impls(kind: str, m: int, n: int, k: int, num_sms: int, sweep: bool) -> dict[str, Callable[..., Any]]:
    """name -> fn(x, qweight, scales, w_bf16) for one case."""
    from tandem.kernels.fp8_linear import fp8_linear_triton
    from tandem.kernels.int8_linear import int8_launch_config, int8_linear_triton
    from tandem.kernels.quant_small_m import SmallMWorkspace, small_m_launch_config

    linear = int8_linear_triton if kind == "int8" else fp8_linear_triton
    workspace = SmallMWorkspace()  # shared by the calls of one graph: each launch leaves its counters zero
    impls: dict[str, Callable[..., Any]] = {
        "bf16": lambda x, q, s, w: torch.nn.functional.linear(x, w),
        "old": lambda x, q, s, w: linear(x, q, s, small_m=False),
    }

    def small(**overrides: Any) -> Callable[..., Any]:
        cfg = small_m_launch_config(m, n, k, 0, num_sms, **overrides)
        return lambda x, q, s, w: linear(x, q, s, config=cfg, workspace=workspace)

    impls["new"] = small()
    impls["new-fma"] = small(fma_max_m=16)
    impls["new-dot"] = small(fma_max_m=0)
    impls["new-2kernel"] = small(fused_reduce=False)
    impls["new-xtile"] = small(x_tile=True)  # M = 1: the activations in the weight tile's layout (no barriers)
    if kind == "int8":  # the weight converted by integer ops instead of I2F (quant_common.int8_to_float32)
        old_bits = int8_launch_config(m, n, k, 0, num_sms, int8_bits=True)
        impls["old-bits"] = lambda x, q, s, w: linear(x, q, s, config=old_bits)
        impls["new-bits"] = small(int8_bits=True)
        impls["new-bits-xtile"] = small(int8_bits=True, x_tile=True)
        impls["new-dot-bits"] = small(fma_max_m=0, int8_bits=True)
    if sweep:
        for variant, fma_max_m in (("fma", 16), ("dot", 0)):
            for per_sm in (1, 2, 4, 8):
                impls[f"new-{variant}-pps{per_sm}"] = small(fma_max_m=fma_max_m, programs_per_sm=per_sm)
        if m == 1:  # the CUDA-core GEMV's tile and warps against the default 16 x 256, 4 warps (32 x 256 before)
            for block_n, block_k, warps in ((32, 256, 4), (32, 128, 4), (32, 512, 4), (64, 256, 8), (32, 256, 8),
                                            (64, 128, 4), (16, 512, 4), (16, 128, 4)):
                cfg = _fma_tile(n, k, num_sms, block_n, block_k, warps, kind == "int8")
                impls[f"new-bits-n{block_n}-k{block_k}-w{warps}"] = \
                    lambda x, q, s, w, cfg=cfg: linear(x, q, s, config=cfg, workspace=workspace)
    return impls


def _fma_tile(n: int, k: int, num_sms: int, block_n: int, block_k: int, num_warps: int, int8_bits: bool) -> Any:
    """`small_m_launch_config`'s M = 1 settings with another tile and warp count, split-K re-derived the same way
    (~4 programs per SM)."""
    import triton

    from tandem.kernels.quant_small_m import small_m_k_per_split, small_m_launch_config

    tiles_n = triton.cdiv(n, block_n)
    split = 1
    if tiles_n < 4 * num_sms:
        split = max(1, min(triton.cdiv(4 * num_sms, tiles_n), k // (2 * block_k), 32))
    split = triton.cdiv(k, small_m_k_per_split(k, block_k, split))
    base = small_m_launch_config(1, n, k, 0, num_sms, int8_bits=int8_bits)
    return base._replace(block_n=block_n, block_k=block_k, num_warps=num_warps, split_k=split,
                         fused_reduce=split > 1)


def time_graph(fn: Callable[[int], Any], copies: int, iters: int, warmup: int, device: torch.device) -> float:
    """Milliseconds per fn(i) call: a CUDA graph of fn(0) .. fn(copies - 1), median of `iters` replays."""
    if device.type != "cuda":
        times = []
        for _ in range(warmup):
            for i in range(copies):
                fn(i)
        for _ in range(iters):
            started = time.perf_counter()
            for i in range(copies):
                fn(i)
            times.append((time.perf_counter() - started) * 1e3 / copies)
        return statistics.median(times)
    for i in range(copies):  # compile, allocate workspaces: outside the capture
        fn(i)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn(0)  # a warm-up on the capture stream (the caching allocator's first use of it)
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(copies):
                fn(i)
    torch.cuda.current_stream(device).wait_stream(stream)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events) / copies


def bind(fn: Callable[..., Any], x: torch.Tensor, qweights: list[torch.Tensor], scales: torch.Tensor,
         w_bf16s: list[torch.Tensor]) -> Callable[[int], Any]:
    """fn on the i-th weight copy (cycling through the quantized ones or, for bf16, the bf16 ones)."""
    return lambda i: fn(x, qweights[i % len(qweights)], scales, w_bf16s[i % len(w_bf16s)])


def rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import triton

    from tandem.kernels.quant_linear import QuantWeight
    from tandem.kernels.quant_small_m import small_m_launch_config

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter's bf16 is not hardware's
    num_sms = 4 if args.dry_run else torch.cuda.get_device_properties(device).multi_processor_count
    projections = PROJECTIONS_DRY if args.dry_run else PROJECTIONS_8B
    wanted = args.projections.split(",") if args.projections else list(projections)
    ms_list = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for kind in args.kinds.split(","):
        for name in wanted:
            n, k = projections[name]
            w = torch.randn(n, k, device=device) / k**0.5
            qw = QuantWeight.quantize(w, kind, clip_search=False)
            w_bf16 = w.to(dtype)
            del w
            weight_bytes = qw.qweight.numel() + qw.scales.numel() * 4
            copies = 2 if args.dry_run else max(2, min(64, -(-args.stream_mb * 2**20 // weight_bytes)))
            qweights = [qw.qweight] + [qw.qweight.clone() for _ in range(copies - 1)]
            bf16_copies = max(2, min(copies, -(-args.stream_mb * 2**20 // (2 * n * k))))
            w_bf16s = [w_bf16] + [w_bf16.clone() for _ in range(bf16_copies - 1)]
            deq = qw.dequantize().double()
            for m in ms_list:
                x = torch.randn(m, k, device=device).to(dtype)
                exact = x.double() @ deq.T
                impls = make_impls(kind, m, n, k, num_sms, args.sweep)
                row: dict[str, Any] = {"kind": kind, "projection": name, "m": m, "n": n, "k": k,
                                       "weight_bytes": weight_bytes, "copies": copies,
                                       "default_config": small_m_launch_config(m, n, k, 0, num_sms)._asdict()}
                for impl, fn in impls.items():
                    is_bf16 = impl == "bf16"
                    ws = w_bf16s if is_bf16 else qweights

                    call = bind(fn, x, ws, qw.scales, w_bf16s)
                    with torch.inference_mode():
                        out = call(0)
                        ms = time_graph(call, len(ws), args.iters, args.warmup, device)
                    moved = (2 * n * k if is_bf16 else weight_bytes) + (m * k + m * n) * x.element_size()
                    gbps = moved / ms / 1e6
                    row[impl] = {"us": ms * 1e3, "bytes": moved, "gbps": gbps, "frac_peak": gbps / PEAK_GBPS,
                                 "rel_err": rel_err(out, exact if not is_bf16 else x.double() @ w_bf16.double().T)}
                rows.append(row)
                print(f"{kind:<5}{name:<8}M={m:<3}" + "".join(
                    f"  {impl} {row[impl]['us']:7.1f}us {100 * row[impl]['frac_peak']:5.1f}%" for impl in impls),
                    flush=True)
    return {
        "benchmark": "quant_gemv",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "machine": {"platform": platform.platform(), "device": str(device), "num_sms": num_sms,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "activation_dtype": str(dtype), "peak_gbps": PEAK_GBPS,
        "timing": {"iters": args.iters, "warmup": args.warmup, "stream_mb": args.stream_mb},
        "results": rows,
    }


def summary(report: dict[str, Any]) -> list[str]:
    """Per kind and M: the four projections' summed time (one decoder layer) per implementation."""
    lines = []
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    for row in report["results"]:
        totals = by_key.setdefault((row["kind"], row["m"]), {})
        for impl, value in row.items():
            if isinstance(value, dict) and "us" in value:
                totals[impl] = totals.get(impl, 0.0) + value["us"]
    for (kind, m), totals in by_key.items():
        lines.append(f"{kind} M={m} layer (sum of projections): " +
                     ", ".join(f"{impl} {us:.1f}us" for impl, us in totals.items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--projections", default="", help="comma-separated subset of qkv,o,gate_up,down")
    parser.add_argument("--m", default="1,4,16", help="token counts")
    parser.add_argument("--sweep", action="store_true", help="also time split-K targets of 1-8 programs per SM")
    parser.add_argument("--iters", type=int, default=None, help="timed graph replays (50; dry run 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed replays first (5; dry run 0)")
    parser.add_argument("--stream-mb", type=int, default=512, help="weight bytes per graph, over all copies")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when tandem.kernels is first imported (in run)
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.quant_gemv needs a CUDA GPU; use --dry-run to check it on the CPU")
    args.iters = args.iters if args.iters is not None else (1 if args.dry_run else 50)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.dry_run else 5)
    report = run(args)
    report["summary"] = summary(report)
    for line in report["summary"]:
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    bad = [(r["kind"], r["projection"], r["m"], impl) for r in report["results"] for impl, v in r.items()
           if isinstance(v, dict) and "rel_err" in v and v["rel_err"] > (0.06 if impl == "old" else 0.02)]
    if bad:
        sys.exit(f"outputs off the dequantized product: {bad}")


if __name__ == "__main__":
    main()

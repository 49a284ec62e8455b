"""Kernel micro-benchmarks: Triton vs the torch reference vs torch.compile(reference), Llama shapes.

    python -m tandem.benchmarks.kernels --out benchmarks/results/kernels-h200.json        (CUDA GPU)
    python -m tandem.benchmarks.kernels --dry-run --out /tmp/kernels-dry.json             (CPU)

For Llama-3.1-8B and Llama-3.2-1B shapes in bf16: each op timed with CUDA events after warm-up,
median of --iters runs, L2 flushed before each run (a decode step streams cold weights and KV);
Triton's output checked against the reference on the same inputs; the bytes each op must move
give GB/s and the fraction of the H200's measured copy bandwidth. The dry run takes the same code
path on CPU with tiny shapes, the kernels in Triton's interpreter, wall-clock timing.
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
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch

PEAK_GBPS = 4250.0  # H200 device-to-device copy, measured (PERFORMANCE.md)
IMPLS = ("triton", "torch", "compiled")
TOLERANCES = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA_8B = ModelShape("llama-3.1-8b", 4096, 14336, 32, 8, 128)
LLAMA_1B = ModelShape("llama-3.2-1b", 2048, 8192, 32, 8, 64)
TINY = ModelShape("tiny", 64, 96, 6, 2, 16)


@dataclass(frozen=True)
class Workload:
    """Which token counts and decode batches to run: the full GPU set, or the dry run's tiny one."""

    num_tokens: tuple[int, ...]  # the elementwise ops: a decode batch and a prefill chunk
    prefill_seq_lens: tuple[int, ...]
    # (batch, context) of decode attention
    decode: tuple[tuple[int, int], ...]
    block_size: int


GPU_WORKLOAD = Workload((256, 4096), (1024,) * 4,
                        ((1, 1024), (8, 1024), (64, 1024), (256, 1024), (1, 4096), (1, 16384)), 16)
DRY_WORKLOAD = Workload((5,), (7, 12), ((1, 40), (3, 21)), 8)


@dataclass
class Case:
    """One op at one shape. `run(fn, args)` calls an implementation; `outputs` picks what to compare."""

    model: str
    op: str
    label: str
    make_args: Callable[[], tuple[Any, ...]]
    bytes_moved: int
    flops: int = 0
    outputs: Callable[[tuple[Any, ...], Any], list[torch.Tensor]] = lambda args, result: [result]
    extra: dict[str, Any] | None = None


def _all_results(args: tuple[Any, ...], result: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(result)


def _the_caches(args: tuple[Any, ...], result: None) -> list[torch.Tensor]:
    return [args[2], args[3]]  # store_kv returns nothing: compare what it wrote


def _clone(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def build_cases(shape: ModelShape, workload: Workload, dtype: torch.dtype, device: torch.device,
                num_sms: int) -> list[Case]:
    from tandem.kernels.paged_decode_attention import choose_num_splits

    e = torch.tensor([], dtype=dtype).element_size()
    H, inter, Hq, Hkv, D = (shape.hidden_size, shape.intermediate_size, shape.num_q_heads,
                            shape.num_kv_heads, shape.head_dim)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=dtype, device=device)

    weight = randn(H)
    cos_sin = torch.randn(8192, D, dtype=torch.float32, device=device)

    def norm_args(T: int) -> tuple[Any, ...]:
        return randn(T, H), weight, 1e-5

    def add_norm_args(T: int) -> tuple[Any, ...]:
        return randn(T, H), randn(T, H), weight, 1e-5

    def silu_args(T: int) -> tuple[Any, ...]:
        return (randn(T, 2 * inter),)

    def rope_args(T: int) -> tuple[Any, ...]:
        return torch.randint(0, cos_sin.shape[0], (T,), device=device), randn(T, Hq, D), randn(T, Hkv, D), cos_sin

    def store_args(T: int) -> tuple[Any, ...]:
        # Twice the blocks the tokens need, slots drawn at random over all of them.
        num_slots = -(-T // workload.block_size) * 2 * workload.block_size
        caches = [torch.zeros(num_slots // workload.block_size, workload.block_size, Hkv, D, dtype=dtype,
                              device=device) for _ in range(2)]
        return randn(T, Hkv, D), randn(T, Hkv, D), *caches, torch.randperm(num_slots, device=device)[:T]

    cases: list[Case] = []
    for T in workload.num_tokens:
        cases += [
            Case(shape.name, "rms_norm", f"T={T}", partial(norm_args, T), bytes_moved=(2 * T * H + H) * e),
            Case(shape.name, "fused_add_rms_norm", f"T={T}", partial(add_norm_args, T),
                 bytes_moved=(4 * T * H + H) * e, outputs=_all_results),
            Case(shape.name, "silu_and_mul", f"T={T}", partial(silu_args, T), bytes_moved=3 * T * inter * e),
            Case(shape.name, "rotary_embedding", f"T={T}", partial(rope_args, T),
                 bytes_moved=2 * T * (Hq + Hkv) * D * e + T * (D * 4 + 8), outputs=_all_results),
            Case(shape.name, "store_kv", f"T={T}", partial(store_args, T),
                 bytes_moved=4 * T * Hkv * D * e + 8 * T, outputs=_the_caches),
        ]
    seq_lens = workload.prefill_seq_lens
    num_tokens = sum(seq_lens)
    bounds = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    causal_pairs = sum(n * (n + 1) // 2 for n in seq_lens)

    def prefill_args() -> tuple[Any, ...]:
        qkv = randn(num_tokens, Hq, D), randn(num_tokens, Hkv, D), randn(num_tokens, Hkv, D)
        return *qkv, cu_seqlens, max(seq_lens), D ** -0.5

    cases.append(Case(shape.name, "prefill_attention", f"{len(seq_lens)}x{max(seq_lens)}", prefill_args,
                      bytes_moved=2 * num_tokens * (Hq + Hkv) * D * e, flops=4 * Hq * D * causal_pairs))
    for batch, context in workload.decode:
        cases.append(_decode_case(shape, batch, context, workload.block_size, dtype, device, num_sms,
                                  choose_num_splits(batch, Hkv, context, num_sms)))
    return cases


def _decode_case(shape: ModelShape, batch: int, context: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_sms: int, num_splits: int) -> Case:
    Hq, Hkv, D = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq

    def make_args() -> tuple[Any, ...]:
        # Random block tables: a sequence's pages are scattered over the whole pool, as after churn.
        block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
        k_cache = torch.randn(num_blocks, block_size, Hkv, D, dtype=dtype, device=device)
        v_cache = torch.randn(num_blocks, block_size, Hkv, D, dtype=dtype, device=device)
        context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, Hq, D, dtype=dtype, device=device)
        return q, k_cache, v_cache, block_tables, context_lens, D ** -0.5

    e = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * Hkv * D * e
    return Case(shape.name, "paged_decode_attention", f"B={batch} ctx={context}", make_args,
                bytes_moved=kv_bytes + 2 * batch * Hq * D * e + batch * blocks_per_seq * 4,
                flops=4 * batch * Hq * D * context, extra={"num_splits": num_splits})


class Timer:
    """Median time of fn() in ms: CUDA events with an L2 flush before each run, or wall clock on CPU.

    On GPU the stream first sleeps ~0.5 ms, so the CPU has queued all of fn()'s launches before the
    start event fires: the events bracket device time, as under a CUDA graph, not Python launch
    overhead between an op's kernels. A host sync inside fn() (the references have some) still
    shows, as it should.
    """

    SLEEP_CYCLES = 1_000_000  # ~0.5 ms at H200 clocks

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        is_cuda = device.type == "cuda"
        # 256 MB > the H200's 60 MB L2: every timed run starts from cold caches, as a decode step does.
        self.flush = torch.empty(64 << 20, dtype=torch.float32, device=device) if is_cuda else None

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.flush is None:
            times = []
            for _ in range(self.iters):
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize(self.device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
        for start, end in events:
            self.flush.zero_()
            torch.cuda._sleep(self.SLEEP_CYCLES)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(start.elapsed_time(end) for start, end in events)


def compare(expected: list[torch.Tensor], actual: list[torch.Tensor],
            dtype: torch.dtype) -> tuple[float, bool]:
    """Largest absolute error over all outputs, and whether all are within the dtype's tolerance."""
    tol = TOLERANCES[dtype]
    max_err, is_ok = 0.0, True
    for exp, act in zip(expected, actual, strict=True):
        exp, act = exp.float(), act.float()
        max_err = max(max_err, (exp - act).abs().max().item() if exp.numel() else 0.0)
        is_ok &= torch.allclose(act, exp, atol=tol, rtol=tol) and not bool(act.isnan().any())
    return max_err, is_ok


def run_case(case: Case, impls: dict[str, Callable[..., Any]], timer: Timer, dtype: torch.dtype,
             skipped: dict[str, str]) -> dict[str, Any]:
    args = case.make_args()
    ref_args, tri_args = _clone(args), _clone(args)
    expected = case.outputs(ref_args, impls["torch"](*ref_args))
    max_err, is_ok = compare(expected, case.outputs(tri_args, impls["triton"](*tri_args)), dtype)
    row: dict[str, Any] = {"model": case.model, "op": case.op, "shape": case.label, "bytes": case.bytes_moved,
                           "flops": case.flops, "max_abs_err": max_err, "ok": is_ok, **(case.extra or {})}
    for name in IMPLS:
        if name in skipped:
            row[name] = {"error": skipped[name]}
            continue
        # In-place ops (rope, fused add, store_kv) rerun on their own copy: values drift, shapes don't.
        run_args = _clone(args)
        try:
            ms = timer(partial(impls[name], *run_args))
        except Exception as exc:  # noqa: BLE001  torch.compile may fail on any op: record it, keep going
            if name != "compiled":
                raise
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        result = {"ms": ms, "gbps": case.bytes_moved / ms / 1e6}
        result["frac_peak"] = result["gbps"] / PEAK_GBPS
        if case.flops:
            result["tflops"] = case.flops / ms / 1e9
        row[name] = result
    return row


def compiled_ops(torch_ops: Any) -> dict[str, Callable[..., Any]]:
    # One compiled function per op; shapes change across cases, so let dynamo go dynamic, and allow
    # enough recompiles that it never silently falls back to eager.
    config = torch._dynamo.config
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = 64
    else:
        config.cache_size_limit = 64
    return {op: torch.compile(getattr(torch_ops, op)) for op in OPS}


OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv",
       "prefill_attention", "paged_decode_attention")


def print_table(rows: list[dict[str, Any]]) -> None:
    def us(r: dict[str, Any], name: str) -> str:
        if "ms" in r[name]:
            return f"{r[name]['ms'] * 1e3:9.1f}"
        return "skipped" if r[name]["error"].startswith("skipped") else "error"

    print(f"{'model':<14}{'op':<24}{'shape':<16}{'triton us':>10}{'torch us':>10}{'compile us':>11}"
          f"{'GB/s':>8}{'%peak':>7}{'x torch':>8}  ok")
    for r in rows:
        tri = r["triton"]
        speedup = r["torch"]["ms"] / tri["ms"]
        print(f"{r['model']:<14}{r['op']:<24}{r['shape']:<16}{us(r, 'triton'):>10}{us(r, 'torch'):>10}"
              f"{us(r, 'compiled'):>11}{tri['gbps']:8.0f}{100 * tri['frac_peak']:6.1f}%{speedup:7.2f}x  "
              f"{'yes' if r['ok'] else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, kernels in Triton's interpreter: checks the harness only")
    parser.add_argument("--iters", type=int, default=None, help="timed runs per impl (100; dry run 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (10; dry run 1)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    parser.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    args = parser.parse_args()
    if args.dry_run:
        # Triton reads this when tandem.kernels is first imported, below.
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, workload, shapes = torch.device("cpu"), torch.float32, DRY_WORKLOAD, [TINY]
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks.kernels needs a CUDA GPU; use --dry-run to check the harness on CPU")
        device, dtype, workload = torch.device("cuda"), torch.bfloat16, GPU_WORKLOAD
        wanted = args.models.split(",")
        shapes = [s for s in (LLAMA_8B, LLAMA_1B) if s.name in wanted]
    import triton

    from tandem.kernels import get_ops

    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    timer = Timer(device, args.warmup if args.warmup is not None else (1 if args.dry_run else 10),
                  args.iters if args.iters is not None else (2 if args.dry_run else 100))
    torch_ops, triton_ops = get_ops("torch"), get_ops("triton")
    compiled = {} if args.no_compile else compiled_ops(torch_ops)
    rows = []
    with torch.inference_mode():
        for shape in shapes:
            for case in build_cases(shape, workload, dtype, device, num_sms):
                impls = {"triton": getattr(triton_ops, case.op), "torch": getattr(torch_ops, case.op)}
                errors = {"compiled": "skipped (--no-compile)"} if args.no_compile else {}
                impls["compiled"] = compiled.get(case.op, impls["torch"])
                start = time.perf_counter()
                rows.append(run_case(case, impls, timer, dtype, errors))
                elapsed = time.perf_counter() - start
                print(f"{case.model} {case.op} {case.label}: {elapsed:.1f}s", file=sys.stderr, flush=True)
    report = {
        "benchmark": "kernels",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "machine": {"platform": platform.platform(), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "num_sms": num_sms},
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version()},
        "dtype": str(dtype), "peak_gbps": PEAK_GBPS, "timing": {"warmup": timer.warmup, "iters": timer.iters},
        "results": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(rows)
    if not all(r["ok"] for r in rows):
        sys.exit("some Triton outputs differ from the reference (see 'ok')")


if __name__ == "__main__":
    main()

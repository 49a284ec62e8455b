"""Throughput of the paged prefill kernel (a prompt chunk attending to its own tokens and to the context already in
the paged cache) over chunk × context shapes, against the contiguous prefill kernel on the same new tokens.

    python -m tandem.benchmarks.chunk_attention --out chunk-attention.json          # GPU, llama-3.1-8b heads
    python -m tandem.benchmarks.chunk_attention --dry-run --out /tmp/c.json         # CPU, interpreter, tiny shapes

FLOPs count the causal work the kernel must do: for a chunk of c new tokens after a context of n, each query
i attends to n + i + 1 keys, so 4 · Hq · D · (c·n + c(c+1)/2) FLOPs (QKᵀ and PV, multiply-add = 2). The contiguous
kernel has no context (n = 0), so its row is the "chunk at the start of a prompt" baseline; a chunk that
followed a context of n tokens with the old kernel would have recomputed all n + c tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tandem.kernels import triton_available
from tandem.kernels.paged_prefill_attention import paged_prefill_attention_triton
from tandem.kernels.prefill_attention import prefill_attention_triton

BLOCK_SIZE = 16


def flops(chunk: int, context: int, num_heads: int, head_dim: int, batch: int) -> float:
    return 4.0 * num_heads * head_dim * (chunk * context + chunk * (chunk + 1) / 2) * batch


def timed(fn: Any, device: str, warmup: int, iters: int) -> float:
    """Median seconds of fn() over iters runs (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def case(chunk: int, context: int, batch: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
         device: str, warmup: int, iters: int) -> dict[str, Any]:
    total = context + chunk
    blocks_per_seq = -(-total // BLOCK_SIZE)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch * chunk, heads, head_dim, generator=g).to(device, dtype)
    k_cache = torch.randn(batch * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * chunk
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    paged_s = timed(lambda: paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, seq_lens, chunk, scale),
                    device, warmup, iters)
    row = {"chunk": chunk, "context": context, "batch": batch, "paged_ms": paged_s * 1e3,
           "paged_tflops": flops(chunk, context, heads, head_dim, batch) / paged_s / 1e12}
    if context == 0:
        k = torch.randn(batch * chunk, kv_heads, head_dim, generator=g).to(device, dtype)
        v = torch.randn_like(k)
        contiguous_s = timed(lambda: prefill_attention_triton(q, k, v, cu, chunk, scale), device, warmup, iters)
        row.update(contiguous_ms=contiguous_s * 1e3,
                   contiguous_tflops=flops(chunk, 0, heads, head_dim, batch) / contiguous_s / 1e12,
                   paged_over_contiguous_time=paged_s / contiguous_s)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes (with TRITON_INTERPRET=1 in the environment)")
    parser.add_argument("--chunks", default="256,512,2048")
    parser.add_argument("--contexts", default="0,1024,4096,16384")
    parser.add_argument("--tokens-per-case", type=int, default=8192,
                        help="new tokens per case (batch = this / chunk, at least 1)")
    parser.add_argument("--heads", default="32,8,128", help="query heads, kv heads, head dim (llama-3.1-8b)")
    args = parser.parse_args()
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    if args.dry_run:
        device, dtype, warmup, iters = "cpu", torch.float32, 0, 1
        chunks, contexts, tokens = [16, 32], [0, 48], 32
        heads, kv_heads, head_dim = 4, 2, 16
    else:
        device, dtype, warmup, iters = "cuda", torch.bfloat16, 5, 20
        chunks = [int(c) for c in args.chunks.split(",")]
        contexts = [int(c) for c in args.contexts.split(",")]
        tokens = args.tokens_per_case
    if not triton_available(torch.device(device)):
        raise SystemExit(f"Triton is not available on {device} (set TRITON_INTERPRET=1 on a CPU)")
    rows = []
    shapes = [(c, n) for c in chunks for n in contexts]
    for chunk, context in tqdm(shapes, desc="chunk x context"):
        rows.append(case(chunk, context, max(1, tokens // chunk), heads, kv_heads, head_dim, dtype, device,
                         warmup, iters))
    result = {"heads": [heads, kv_heads, head_dim], "dtype": str(dtype), "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'chunk':>6} {'context':>8} {'batch':>5} {'paged ms':>9} {'TFLOP/s':>8} {'contig TFLOP/s':>15}")
    for r in rows:
        contiguous = f"{r['contiguous_tflops']:.1f}" if "contiguous_tflops" in r else "-"
        print(f"{r['chunk']:>6} {r['context']:>8} {r['batch']:>5} {r['paged_ms']:>9.3f} {r['paged_tflops']:>8.1f} "
              f"{contiguous:>15}")


if __name__ == "__main__":
    main()

"""Decode attention's tile settings, bf16 against fp8 KV caches (#18: an fp8 cache's step streamed at ~half the
bandwidth of a bf16 one's).

    python -m tandem.benchmarks.decode_attention_sweep --out /tmp/decode-attention-sweep.json
    python -m tandem.benchmarks.decode_attention_sweep --dry-run --out /tmp/dry.json     (CPU, interpreter)

For each cache dtype, batch and context (llama-3.1-8b's heads: 32 query, 8 kv, D 128; 16-token pages scattered over
the pool), `paged_decode_attention_triton` with the default tile (`decode_attention_config`) and, for fp8 caches, each
candidate of --fp8-tiles ("BLOCK_N,WARPS,STAGES[,f16]"). Timing as a decode step runs it: one CUDA graph replays
the kernel over L layers' caches (L so that the graph streams >= --stream-mb, beyond L2), time per layer = graph
time / L, median of --iters replays. Reported per call: us, GB/s of K/V + q + out + block tables, the fraction of
this card's copy bandwidth (`gpu_engine.hbm_bytes_per_s`), and the largest difference from the reference's output.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

HEADS_8B = (32, 8, 128)
HEADS_DRY = (8, 2, 64)
BLOCK_SIZE = 16
DEFAULT_FP8_TILES = ("64,4,2,f16", "128,4,2", "128,4,2,f16", "128,8,2,f16", "128,4,3,f16", "128,8,3,f16",
                     "64,8,2,f16", "256,8,2,f16")


Caches = tuple[list[tuple[torch.Tensor, ...]], torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


def _caches(num_layers: int, batch: int, context: int, heads: tuple[int, int, int], kv_dtype: str,
            device: torch.device, dtype: torch.dtype) -> Caches:
    """Per layer (k, v) pools of batch x context tokens in shuffled 16-token pages; the shared block tables,
    context lengths and (fp8) unit scales per kv head."""
    from tandem.kernels.fp8_kv import quantize_kv

    _, num_kv, head_dim = heads
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scales = torch.ones(num_kv, device=device) if kv_dtype == "fp8" else None
    layers = []
    for _ in range(num_layers):
        pair = []
        for _ in range(2):
            x = torch.randn(num_blocks, BLOCK_SIZE, num_kv, head_dim, device=device, dtype=dtype)
            pair.append(quantize_kv(x, scales) if scales is not None else x)
            del x
        layers.append(tuple(pair))
    return layers, block_tables, lens, scales, scales


def _time_shape(kv_dtype: str, batch: int, context: int, num_layers: int, heads: tuple[int, int, int],
                device: torch.device, dtype: torch.dtype, num_sms: int, bandwidth: float, tiles: list[Any],
                args: argparse.Namespace) -> dict[str, Any]:
    """The default tile and (fp8) each candidate on one shape: time per layer, bandwidth, error vs the reference."""
    from tandem.benchmarks.quant_gemv import time_graph
    from tandem.kernels.paged_decode_attention import (
        choose_num_splits,
        decode_attention_config,
        paged_decode_attention_ref,
        paged_decode_attention_triton,
    )

    num_q, num_kv, head_dim = heads
    layers, tables, lens, k_scale, v_scale = _caches(num_layers, batch, context, heads, kv_dtype, device, dtype)
    q = torch.randn(batch, num_q, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    num_splits = choose_num_splits(batch, num_kv, context, num_sms)
    scales = {"k_scale": k_scale, "v_scale": v_scale} if k_scale is not None else {}
    expected = paged_decode_attention_ref(q, *layers[0], tables, lens, head_dim ** -0.5, **scales).float()
    default = decode_attention_config(head_dim, kv_dtype == "fp8", num_splits)
    candidates = [default] + ([t for t in tiles if t != default] if kv_dtype == "fp8" else [])
    elem = 1 if kv_dtype == "fp8" else 2
    moved = 2 * batch * context * num_kv * head_dim * elem + 2 * q.numel() * q.element_size() + tables.numel() * 4
    row: dict[str, Any] = {"kv_dtype": kv_dtype, "batch": batch, "context": context, "num_splits": num_splits,
                           "layers": num_layers, "bytes": moved, "tiles": []}

    def call(cfg: Any, i: int) -> torch.Tensor:
        k, v = layers[i]
        return paged_decode_attention_triton(q, k, v, tables, lens, head_dim ** -0.5, num_splits=num_splits, out=out,
                                             config=cfg, **scales)

    for cfg in candidates:
        with torch.inference_mode():
            error = (call(cfg, 0).float() - expected).abs().max().item()
            ms = time_graph(functools.partial(call, cfg), num_layers, args.iters, args.warmup, device)
        gbps = moved / ms / 1e6
        row["tiles"].append({"tile": cfg._asdict(), "default": cfg == default, "us": ms * 1e3, "gbps": gbps,
                             "frac_copy_bw": gbps * 1e9 / bandwidth, "max_abs_err": error})
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import triton

    # Imported here: the interpreter's switch ($TRITON_INTERPRET, set by main) is read when the kernels first load.
    from tandem.benchmarks.gpu_engine import hbm_bytes_per_s
    from tandem.kernels.paged_decode_attention import DecodeAttentionConfig

    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16  # the interpreter's bf16 dots are not hardware's
    heads = HEADS_DRY if dry else HEADS_8B
    num_q, num_kv, head_dim = heads
    num_sms = 4 if dry else torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = 1e12 if dry else hbm_bytes_per_s("cuda")
    tiles = [DecodeAttentionConfig.parse(t) for t in args.fp8_tiles.split(";")] if args.fp8_tiles else \
        [DecodeAttentionConfig.parse(t) for t in DEFAULT_FP8_TILES]
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for kv_dtype in args.kv_dtypes.split(","):
        elem = 1 if kv_dtype == "fp8" else 2
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                kv_bytes = 2 * batch * context * num_kv * head_dim * elem
                num_layers = 2 if dry else max(2, min(32, -(-args.stream_mb * 2**20 // kv_bytes)))
                row = _time_shape(kv_dtype, batch, context, num_layers, heads, device, dtype, num_sms, bandwidth,
                                  tiles, args)
                row["bytes_per_layer_kv"] = kv_bytes
                rows.append(row)
                default, best = row["tiles"][0], min(row["tiles"], key=lambda t: t["us"])
                print(f"{kv_dtype:<5} B={batch:<4} ctx={context:<6} splits={row['num_splits']:<3} default "
                      f"{default['us']:8.1f}us {100 * default['frac_copy_bw']:5.1f}%  best "
                      f"{tuple(best['tile'].values())} {best['us']:8.1f}us {100 * best['frac_copy_bw']:5.1f}%",
                      flush=True)
    return {
        "benchmark": "decode_attention_sweep",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "tandem.benchmarks.decode_attention_sweep",
                             *sys.argv[1:]]),
        "dry_run": dry,
        "machine": {"platform": platform.platform(), "device": str(device), "num_sms": num_sms,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "heads": {"q": num_q, "kv": num_kv, "head_dim": head_dim}, "block_size": BLOCK_SIZE,
        "copy_bandwidth_tb_per_s": bandwidth / 1e12,
        "timing": {"iters": args.iters, "warmup": args.warmup, "stream_mb": args.stream_mb},
        "results": rows,
    }


def summary(report: dict[str, Any]) -> list[str]:
    """One line per shape: the default tile and, where others ran, the fastest."""
    lines = []
    for row in report["results"]:
        default = next(t for t in row["tiles"] if t["default"])
        best = min(row["tiles"], key=lambda t: t["us"])
        tile = ",".join(str(v) for v in best["tile"].values())
        lines.append(f"{row['kv_dtype']} batch {row['batch']} ctx {row['context']}: default {default['us']:.1f} us "
                     f"({100 * default['frac_copy_bw']:.0f}% of copy bandwidth), best {tile} {best['us']:.1f} us "
                     f"({100 * best['frac_copy_bw']:.0f}%)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    parser.add_argument("--kv-dtypes", default="bf16,fp8")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--fp8-tiles", default="",
                        help="fp8 candidates, each BLOCK_N,WARPS,STAGES[,f16], separated by ';' (default: a set)")
    parser.add_argument("--iters", type=int, default=None, help="timed graph replays (20; dry run 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed replays first (3; dry run 0)")
    parser.add_argument("--stream-mb", type=int, default=1024, help="K/V bytes per graph, over all layers")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when tandem.kernels is first imported (in run)
        args.batches, args.contexts = "1,3", "40"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.decode_attention_sweep needs a CUDA GPU; use --dry-run to check it on the CPU")
    args.iters = args.iters if args.iters is not None else (1 if args.dry_run else 20)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.dry_run else 3)
    report = run(args)
    report["summary"] = summary(report)
    for line in report["summary"]:
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    bad = [(r["kv_dtype"], r["batch"], r["context"], t["tile"]) for r in report["results"] for t in r["tiles"]
           if t["max_abs_err"] > 0.05]
    if bad:
        sys.exit(f"outputs off the reference: {bad}")


if __name__ == "__main__":
    main()

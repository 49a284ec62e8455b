"""Quantized weights and the fp8 KV cache (issue #18): decode step vs the HBM floor, offline throughput, and the
CPU's int8 path.

    python -m tandem.benchmarks.quant decode-latency --out DIR     # GPU: bf16, int8, fp8, fp8 + fp8 KV at 1/64/256
    python -m tandem.benchmarks.quant offline --out DIR            # GPU: 256 x (1,024 prompt, 128 output) per variant
    python -m tandem.benchmarks.quant offline --num-requests 1024 --prompt-len 1000 --max-tokens 1000 --out DIR
    python -m tandem.benchmarks.quant cpu --out DIR                # CPU: SmolLM2-135M decode, fp32 vs int8, memory
    TRITON_INTERPRET=1 python -m tandem.benchmarks.quant decode-latency --dry-run --out /tmp/q   # the code, on CPU

Each writes `<command>.json` under DIR (`quant-cpu.json` for `cpu`) and prints its rows. GPU weights are random
(`dummy:` of real shapes, quantized at load like real ones): speed does not depend on the values. The floor of a
decode step is the bytes it must read (every weight once, in its stored dtype, plus the batch's K/V) over the HBM
copy bandwidth; `fraction_of_floor` is floor / measured step. HF transformers runs in the same suite through
`tandem.benchmarks.gpu_engine hf`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tandem.benchmarks.gpu_engine import (
    check_floor,
    engine_config,
    environment,
    free_memory,
    hbm_bytes_per_s,
    kv_bytes_per_token,
    random_prompts,
    steady_step_times,
    sync,
)
from tandem.common.config import EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.quantization import weight_bytes
from tandem.engine.runner import ModelRunner
from tandem.models import load_model_config

# (label, quantization, kv_cache_dtype)
VARIANTS = {"bf16": (None, "auto"), "int8": ("int8", "auto"), "fp8": ("fp8", "auto"), "fp8+fp8kv": ("fp8", "fp8")}


def with_variant(config: EngineConfig, variant: str) -> EngineConfig:
    quantization, kv_cache_dtype = VARIANTS[variant]
    return replace(config, model=replace(config.model, quantization=quantization),
                   cache=replace(config.cache, kv_cache_dtype=kv_cache_dtype))


def streamed_weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step reads of the weights, each in its stored dtype (quantized codes and scales included):
    every parameter and buffer except the embedding table, which is only gathered (unless tied, where the output
    layer reads all of it)."""
    model = runner.model
    skip = None if runner.config.model.tie_word_embeddings else model.model.embed_tokens.weight.data_ptr()
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.data_ptr() != skip}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_steps(engine: Engine, batch: int, context: int, num_steps: int, device: str) -> tuple[list[float], float]:
    """Seconds of each of `num_steps` decode steps of `batch` requests with `context`-token prompts (back to back:
    `steady_step_times`), and the mean number of tokens in the batch's KV during them (requests that finished their
    prompt early in a chunked prefill have decoded a few tokens more)."""
    # As many tokens as the context allows: none must finish before the timed steps end.
    params = SamplingParams(max_tokens=engine.config.max_model_len - context, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, engine.config.model.vocab_size, seed=batch)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while True:  # prefill everything (in chunks), up to the first step that decodes the whole batch
        result = engine.step()
        if not result.is_prefill and len(result.requests) == batch:
            break
    for _ in range(2):
        engine.step()  # warm-up decode steps
    kv_tokens = []

    def check(result: Any) -> None:
        assert not result.is_prefill and len(result.requests) == batch, "a step that was not a full decode step"
        kv_tokens.append(sum(r.num_tokens for r in engine.requests.values()))

    times = steady_step_times(engine, num_steps, device, check)
    for req_id in list(engine.requests):
        engine.abort(req_id)
    return times, statistics.mean(kv_tokens)


# -- GPU: decode step vs the floor -------------------------------------------------------------------------------
def decode_latency(args: argparse.Namespace) -> dict[str, Any]:
    model = "dummy:tiny" if args.dry_run else args.model
    batches = [1, 4] if args.dry_run else [int(b) for b in args.batches.split(",")]
    context = 32 if args.dry_run else args.context
    num_steps = 4 if args.dry_run else args.steps
    bandwidth = hbm_bytes_per_s(args.device)
    rows = []
    for variant in args.variants.split(","):
        config = with_variant(engine_config(model, args.device, max_model_len=context + num_steps + 128,
                                            max_num_seqs=max(batches), max_num_batched_tokens=16384), variant)
        engine = Engine(config)
        wbytes = streamed_weight_bytes(engine.runner)
        kvb = kv_bytes_per_token(engine.runner)
        for batch in tqdm(batches, desc=f"{model} {variant}"):
            times, kv_tokens = decode_steps(engine, batch, context, num_steps, args.device)
            step_s = statistics.median(times)
            floor_s = (wbytes + kv_tokens * kvb) / bandwidth
            rows.append({"model": model, "variant": variant, "batch": batch, "context": context,
                         "step_ms": step_s * 1e3, "tok_per_s": batch / step_s, "floor_ms": floor_s * 1e3,
                         "fraction_of_floor": floor_s / step_s, "hbm_tb_per_s": bandwidth / 1e12,
                         "weight_gb": wbytes / 1e9, "kv_gb_per_step": kv_tokens * kvb / 1e9,
                         "kv_blocks": engine.runner.kv_cache.num_blocks})
            args.out.mkdir(parents=True, exist_ok=True)  # survives a timeout
            (args.out / "quant-decode-latency.partial.json").write_text(json.dumps({"rows": rows}, indent=1))
            print(rows[-1], flush=True)
            check_floor(rows[-1])
        del engine
        free_memory()
    return {"rows": rows}


# -- GPU: offline throughput ------------------------------------------------------------------------------------
def offline(args: argparse.Namespace) -> dict[str, Any]:
    from tandem import LLM

    model = "dummy:tiny" if args.dry_run else args.model
    num, prompt_len, max_tokens = (8, 32, 8) if args.dry_run else (args.num_requests, args.prompt_len,
                                                                   args.max_tokens)
    rows = []
    for variant in args.variants.split(","):
        quantization, kv_cache_dtype = VARIANTS[variant]
        llm = LLM(model, device=args.device, max_model_len=prompt_len + max_tokens + 16,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                  enable_chunked_prefill=not args.no_chunked_prefill)
        prompts = random_prompts(num, prompt_len, llm.config.model.vocab_size)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        sync(args.device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        sync(args.device)
        elapsed = time.perf_counter() - start
        num_tokens = sum(len(o.token_ids) for o in outputs)
        rows.append({"model": model, "variant": variant, "num_requests": num, "prompt_len": prompt_len,
                     "max_tokens": max_tokens, "seconds": elapsed, "output_tokens": num_tokens,
                     "output_tok_per_s": num_tokens / elapsed, "kv_blocks": llm.engine.runner.kv_cache.num_blocks})
        print(rows[-1], flush=True)
        del llm
        free_memory()
    base = next((r["output_tok_per_s"] for r in rows if r["variant"] == "bf16"), None)
    for row in rows:
        row["speedup_vs_bf16"] = row["output_tok_per_s"] / base if base else None
    return {"rows": rows, "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_chunked_prefill": not args.no_chunked_prefill}


# -- CPU: SmolLM2-135M, fp32 (oneDNN) vs int8 (torch._weight_int8pack_mm) ---------------------------------------
def _cpu_engine(model: str, quantization: str | None, max_num_seqs: int, max_model_len: int) -> Engine:
    config = EngineConfig.create(load_model_config(model), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 num_kv_blocks=max_num_seqs * -(-max_model_len // 16), quantization=quantization)
    return Engine(config)


def _resident_mb_after_load(model: str, quantization: str | None) -> dict[str, float]:
    """Resident memory (MiB) of a fresh process that has loaded the model (weights, torch, tokenizer, a small KV
    pool), as loaded and after glibc's malloc_trim: the quantized model is built in fp32 first, and glibc keeps
    most of the freed fp32 weights mapped until asked to give them back."""
    script = ("import ctypes, json, resource; from tandem.benchmarks.quant import _cpu_engine; "
              f"e = _cpu_engine({model!r}, {quantization!r}, 1, 64); "
              "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() / 2**20; "
              "loaded = rss(); ctypes.CDLL('libc.so.6').malloc_trim(0); "
              "print(json.dumps({'as_loaded': loaded, 'after_malloc_trim': rss()}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def cpu(args: argparse.Namespace) -> dict[str, Any]:
    variants = {"fp32": None, "int8": "int8"}
    batches = [int(b) for b in args.cpu_batches.split(",")]
    engines = {name: _cpu_engine(args.cpu_model, q, max(batches), args.cpu_context + args.steps + 64)
               for name, q in variants.items()}
    memory = {name: {"weight_mb": weight_bytes(engine.runner.model) / 2**20,
                     "resident_mb": _resident_mb_after_load(args.cpu_model, variants[name])}
              for name, engine in engines.items()}
    load_before = os.getloadavg()
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for batch in batches:
            times: dict[str, list[float]] = {name: [] for name in engines}
            # Rounds alternate the variants, so that load from elsewhere on the host falls on both alike.
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    times[name] += decode_steps(engine, batch, args.cpu_context, args.steps, "cpu")[0]
            for name, ts in times.items():
                ts.sort()
                rows.append({"variant": name, "threads": threads, "batch": batch, "context": args.cpu_context,
                             "steps": len(ts), "step_ms_median": statistics.median(ts) * 1e3,
                             "step_ms_p10": ts[len(ts) // 10] * 1e3, "tok_per_s": batch / statistics.median(ts)})
                print(rows[-1], flush=True)
    by = {(r["variant"], r["threads"], r["batch"]): r for r in rows}
    speedup = {f"threads={t},batch={b}": by["fp32", t, b]["step_ms_median"] / by["int8", t, b]["step_ms_median"]
               for _, t, b in by if _ == "fp32"}
    return {"model": args.cpu_model, "cpu_count": os.cpu_count(), "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "memory": memory, "rows": rows,
            "int8_speedup_median_step": speedup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["decode-latency", "offline", "cpu"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, dummy:tiny, a few steps")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="offline: whole prompts in steps of their own (the budget must hold the longest)")
    parser.add_argument("--cpu-model", default="smollm2-135m")
    parser.add_argument("--cpu-batches", default="1,16")
    parser.add_argument("--cpu-context", type=int, default=128, help="cpu: prompt tokens of each decoding request")
    parser.add_argument("--threads", default="1,2", help="cpu: torch thread counts to measure, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=3, help="cpu: alternating rounds of --steps steps per variant")
    args = parser.parse_args()
    if args.command == "cpu":
        args.device = "cpu"
    else:
        args.device = "cpu" if args.dry_run else "cuda"
        if args.dry_run:
            # The Triton path on CPU needs the interpreter, chosen before triton is first imported.
            assert os.environ.get("TRITON_INTERPRET") == "1", "run the dry run with TRITON_INTERPRET=1"
    command = {"decode-latency": decode_latency, "offline": offline, "cpu": cpu}
    result = command[args.command](args)
    report = {"benchmark": f"quant {args.command}", "environment": environment(), "dry_run": args.dry_run,
              "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "quant-cpu" if args.command == "cpu" else f"quant-{args.command}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(result, indent=1)[:3000])


if __name__ == "__main__":
    main()

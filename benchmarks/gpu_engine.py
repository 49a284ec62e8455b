"""Engine-level GPU checks and benchmarks (run on one H200; `--dry-run` exercises the code on CPU).

    python -m tandem.benchmarks.gpu_engine correctness --out DIR
    python -m tandem.benchmarks.gpu_engine decode-latency --out DIR
    python -m tandem.benchmarks.gpu_engine decode-latency --fusions none,rope_store,add_norm,all --out DIR
        (each set of kernel fusions alone, `tandem.kernels.ops`: decode-latency-fusions.json, with `ablation`)
    python -m tandem.benchmarks.gpu_engine offline --out DIR
    python -m tandem.benchmarks.gpu_engine hf --mode static|batch --out DIR

Each writes `<command>.json` under DIR and prints a short table last. Weights are random (`dummy:`)
of real shapes; correctness compares the Triton path with the pure-torch reference on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.step_plan import num_blocks_for
from tandem.kernels import get_ops
from tandem.kernels.ops import fusions_label, parse_fusions
from tandem.models import load_model_config

HBM_BYTES_PER_S = 4.25e12  # copy bandwidth measured on one H200 (PERFORMANCE guide); the CPU's dry runs use it
_COPY_BYTES = 2 << 30


def hbm_bytes_per_s(device: str) -> float:
    """The floors' bandwidth: on a GPU, measured here (the best of 10 device-to-device copies of 2 GiB, bytes read
    plus bytes written), so that a floor is this card's (an H100 copies ~3.0 TB/s, an H200 ~4.3); else the H200's."""
    if not device.startswith("cuda"):
        return HBM_BYTES_PER_S
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    free_memory()
    return 2 * _COPY_BYTES / best


def environment() -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    # The kernel switches read from the environment (their defaults when unset).
    env["switches"] = {name: value for name, value in sorted(os.environ.items()) if name.startswith("TANDEM_")}
    return env


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 49152)) for _ in range(length)] for _ in range(num)]


def engine_config(model: str, device: str, *, max_model_len: int, max_num_seqs: int = 256,
                  num_blocks: int | None = None, use_triton: bool = True, use_cuda_graphs: bool = True,
                  max_num_batched_tokens: int = 8192) -> EngineConfig:
    return EngineConfig(
        model=load_model_config(model, fetch=False),
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  max_num_batched_tokens=max(max_num_batched_tokens, max_model_len)),
        device=device, use_triton=use_triton, use_cuda_graphs=use_cuda_graphs)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def steady_step_times(engine: Any, num_steps: int, device: str,
                      check: Callable[[Any], None] | None = None) -> list[float]:
    """Seconds between the returns of `num_steps` consecutive `engine.step()` calls after one untimed call, with no
    synchronisation in between: what a step costs while the engine runs steps back to back. With async scheduling
    (on by default on a GPU) a call launches the next step and then waits for the one in flight, so a
    synchronisation before each call would empty the queue and time only the host's part of a step (an 8B decode
    step measured 0.4 ms, 9x faster than its HBM floor). `check(result)` runs on each step's result, untimed."""
    sync(device)
    result = engine.step()
    if check is not None:
        check(result)
    times = []
    last = time.perf_counter()
    for _ in range(num_steps):
        result = engine.step()
        now = time.perf_counter()
        times.append(now - last)
        if check is not None:
            check(result)
        last = time.perf_counter()
    sync(device)
    return times


def check_floor(row: dict[str, Any]) -> None:
    """A step faster than its HBM floor is a timing error (the GPU's work was not waited for), never a result."""
    if row["fraction_of_floor"] > 1.05:
        raise RuntimeError(f"{row['model']} {row['variant']} batch {row['batch']}: {row['step_ms']:.3f} ms per step "
                           f"is {row['fraction_of_floor']:.2f}x its HBM floor of {row['floor_ms']:.3f} ms: the "
                           "timing does not wait for the GPU")


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- correctness: kernel path against the reference path, same weights ---------------------------------
def teacher_forced(runner: ModelRunner, prompts: list[list[int]], num_steps: int,
                   forced: list[list[int]] | None = None) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [B, num_steps + 1, V] (float32, on the CPU) of each prompt followed by `forced` tokens,
    or, without `forced`, by its own greedy continuation; also returns the tokens fed."""
    pool = BlockPool(runner.kv_cache.num_blocks)
    bs = runner.block_size
    requests = []
    for i, prompt in enumerate(prompts):
        r = Request(req_id=str(i), prompt_token_ids=prompt, params=SamplingParams(max_tokens=1), seed=0)
        r.block_ids = pool.allocate(num_blocks_for(len(prompt), bs))
        requests.append(r)
    fed: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        steps = [runner.prefill_logits(requests, None).float().cpu()]
        for n in range(num_steps):
            for i, r in enumerate(requests):
                token = forced[i][n] if forced is not None else int(steps[-1][i].argmax())
                fed[i].append(token)
                r.output_token_ids.append(token)
                if num_blocks_for(r.num_tokens, bs) > len(r.block_ids):
                    r.block_ids += pool.allocate(1)
            steps.append(runner.decode_logits(requests).float().cpu())
    return torch.stack(steps, dim=1), fed


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    model = "dummy:tiny" if args.dry_run else args.model
    lengths = [5, 17] if args.dry_run else [17, 100, 250, 33]
    num_steps = 8 if args.dry_run else args.steps
    max_len = max(lengths) + num_steps + 1
    prompts = random_prompts(len(lengths), max(lengths), 49152)
    prompts = [p[:n] for p, n in zip(prompts, lengths, strict=True)]
    results: dict[str, Any] = {"model": model, "prompt_lens": lengths, "num_steps": num_steps,
                               "fusions": fusions_label(get_ops("triton").fusions)}  # $TANDEM_FUSIONS
    runners = {}
    for backend in ("torch", "triton"):
        config = engine_config(model, args.device, max_model_len=max_len + 16, max_num_seqs=8,
                               num_blocks=4 * num_blocks_for(max_len + 16, 16), use_triton=backend == "triton")
        runner = ModelRunner(config, ops=get_ops(backend))
        runners[backend] = runner
    ref_runner, kernel_runner = runners["torch"], runners["triton"]
    # Same seed on the same device: the same weights. Check it rather than assume it.
    for (name, a), (_, b) in zip(ref_runner.model.named_parameters(), kernel_runner.model.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), f"weights differ at {name}"
    # The reference's own greedy continuation is the forced sequence for both paths.
    ref_logits, forced = teacher_forced(ref_runner, prompts, num_steps)
    kernel_logits, _ = teacher_forced(kernel_runner, prompts, num_steps, forced)
    diff = (kernel_logits - ref_logits).abs()
    top2 = ref_logits.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    mismatch = kernel_logits.argmax(-1) != ref_logits.argmax(-1)
    # A flip is explained by rounding when the reference's top-two gap at that position is within what
    # the two paths differ by there (bf16 noise, accumulated over the layers); otherwise it is an error.
    position_noise = 2 * diff.max(dim=-1).values
    unexplained = mismatch & (gap > position_noise)
    tolerance = 0.0 if args.dry_run else args.logit_tolerance
    results.update({
        "max_abs_logit_diff": diff.max().item(),
        "mean_abs_logit_diff": diff.mean().item(),
        "logit_std": ref_logits.std().item(),
        "positions": int(mismatch.numel()),
        "argmax_mismatches": int(mismatch.sum().item()),
        "argmax_mismatches_unexplained_by_noise": int(unexplained.sum().item()),
        "largest_gap_at_a_mismatch": float(gap[mismatch].max().item()) if mismatch.any() else 0.0,
        "logit_tolerance": tolerance,
    })
    results["passed"] = (results["argmax_mismatches_unexplained_by_noise"] == 0
                         and (args.dry_run or results["max_abs_logit_diff"] <= tolerance))
    return results


# -- decode step latency ---------------------------------------------------------------------------------
def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step streams: every parameter except the embedding table, which is only gathered
    (unless tied, where the output layer reads all of it)."""
    model = runner.model
    total = 0
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" and not runner.config.model.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(runner: ModelRunner) -> int:
    m = runner.config.model
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * runner.kv_cache.tensor.element_size()


def decode_steps(engine: Any, batch: int, context: int, num_steps: int, device: str
                 ) -> tuple[list[float], list[list[int]]]:
    """Seconds of each of `num_steps` decode steps of `batch` greedy requests with random `context`-token prompts
    (after their prefill and 3 warm-up decode steps; `steady_step_times`), and each request's tokens; the requests
    are aborted after."""
    prompts = random_prompts(batch, context, engine.config.model.vocab_size, seed=batch)
    params = SamplingParams(max_tokens=num_steps + 12, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"b{batch}-{i}", p, params) for i, p in enumerate(prompts)]
    while engine.scheduler.waiting:
        engine.step()  # prefill everything first
    for _ in range(3):
        engine.step()  # warm-up decode steps

    def check(result: Any) -> None:
        assert not result.is_prefill and len(result.requests) == batch, "a step that was not a full decode step"

    times = steady_step_times(engine, num_steps, device, check)
    for req_id in list(engine.requests):
        engine.abort(req_id)
    return times, [list(r.output_token_ids) for r in requests]


def decode_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Decode step time vs the HBM floor per model, variant and batch. With `--fusions`, the variants are the Triton
    path with CUDA graphs under each set of fusions (`tandem.kernels.ops`), and the result adds `ablation`: per
    model and batch, each set's step time and fraction of the floor, against the first set's."""
    from tandem.engine.engine import Engine

    models = ["dummy:tiny"] if args.dry_run else args.models.split(",")
    default_batches = "1,64" if args.fusions else "1,8,64,256"
    batches = [1, 4] if args.dry_run else [int(b) for b in (args.batches or default_batches).split(",")]
    context = 32 if args.dry_run else args.context
    num_steps = 4 if args.dry_run else args.steps
    # (label, use_triton, use_cuda_graphs, fusions: None for the process's default)
    variants: list[tuple[str, bool, bool, frozenset[str] | None]] = []
    if args.fusions:
        for spec in args.fusions.split(","):
            fusions = parse_fusions(spec)
            variants.append((f"triton+graphs fusions={fusions_label(fusions)}", True, True, fusions))
    else:
        variants.append(("triton+graphs", True, True, None))
        if args.variants == "all":
            variants += [("triton eager", True, False, None), ("torch eager", False, False, None)]
    name = "decode-latency-fusions" if args.fusions else "decode-latency"
    bandwidth = hbm_bytes_per_s(args.device)
    rows = []
    tokens: dict[tuple[str, int], list[list[int]]] = {}  # (model, batch) -> the first variant's tokens
    for model in models:
        for label, use_triton, use_graphs, fusions in variants:
            config = engine_config(model, args.device, max_model_len=context + num_steps + 32,
                                   max_num_seqs=max(batches), use_triton=use_triton, use_cuda_graphs=use_graphs,
                                   max_num_batched_tokens=16384)
            runner = None if fusions is None else ModelRunner(config, ops=get_ops("triton", fusions))
            engine = Engine(config, runner)
            wbytes = weight_bytes(engine.runner)
            kvb = kv_bytes_per_token(engine.runner)
            for batch in tqdm(batches, desc=f"{model} {label}"):
                if batch > 1 and not label.startswith("triton+graphs") and batch not in (1, 64):
                    continue
                times, outputs = decode_steps(engine, batch, context, num_steps, args.device)
                step_s = statistics.median(times)
                mean_ctx = context + 4 + num_steps / 2
                floor_s = (wbytes + batch * mean_ctx * kvb) / bandwidth
                partial = args.out / f"{name}.partial.json"  # survives a timeout
                row = {"model": model, "variant": label, "batch": batch, "context": context,
                       "step_ms": step_s * 1e3, "tok_per_s": batch / step_s, "floor_ms": floor_s * 1e3,
                       "fraction_of_floor": floor_s / step_s, "hbm_tb_per_s": bandwidth / 1e12,
                       "weight_gb": wbytes / 1e9, "kv_gb_per_step": batch * mean_ctx * kvb / 1e9}
                if fusions is not None:
                    # The fusions change launches, not arithmetic: every set must give the first set's tokens.
                    row["fusions"] = fusions_label(fusions)
                    row["same_tokens_as_first"] = tokens.setdefault((model, batch), outputs) == outputs
                rows.append(row)
                check_floor(row)
                args.out.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
                print(rows[-1], flush=True)
            del engine, runner
            free_memory()
    result: dict[str, Any] = {"rows": rows}
    if args.fusions:
        result["ablation"] = fusion_ablation(rows)
    return result


def fusion_ablation(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and batch: each fusion set's step time and fraction of the floor, and its time saved against the
    first set measured (the baseline: put "none" first)."""
    table = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows if r["model"] == model):
            group = [r for r in rows if r["model"] == model and r["batch"] == batch]
            base = group[0]
            table.append({
                "model": model, "batch": batch, "baseline": base["fusions"],
                "all_same_tokens": all(r["same_tokens_as_first"] for r in group),
                "by_fusions": {r["fusions"]: {
                    "step_ms": round(r["step_ms"], 4),
                    "percent_of_floor": round(100 * r["fraction_of_floor"], 2),
                    "ms_saved_vs_baseline": round(base["step_ms"] - r["step_ms"], 4),
                    "percent_faster_vs_baseline": round(100 * (base["step_ms"] / r["step_ms"] - 1), 2),
                } for r in group},
            })
    return table


# -- where a decode step's time goes -------------------------------------------------------------------------
def profile(args: argparse.Namespace) -> dict[str, Any]:
    """torch.profiler over decode steps: device time per kernel, and the host's share of the step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from tandem.engine.engine import Engine

    model = "dummy:tiny" if args.dry_run else args.model
    batch = 2 if args.dry_run else int((args.batches or "1").split(",")[0])
    context = 32 if args.dry_run else args.context
    num_steps = 3 if args.dry_run else 20
    config = engine_config(model, args.device, max_model_len=context + num_steps + 64, max_num_seqs=max(batch, 8))
    if args.quantization:  # the profile of a quantized model's step (`--quantization int8|fp8`)
        config = replace(config, model=replace(config.model, quantization=args.quantization))
    engine = Engine(config)
    params = SamplingParams(max_tokens=num_steps + 16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, context, config.model.vocab_size)):
        engine.add_request(f"p{i}", p, params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    sync(args.device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        for _ in range(num_steps):
            engine.step()
        sync(args.device)
    wall_ms = (time.perf_counter() - start) / num_steps * 1e3
    sort_key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=25)
    name = f"profile-{args.quantization}.txt" if args.quantization else "profile.txt"
    (args.out / name).parent.mkdir(parents=True, exist_ok=True)
    (args.out / name).write_text(table)
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / num_steps
    return {"model": model, "batch": batch, "context": context, "steps": num_steps,
            "step_wall_ms_under_profiler": wall_ms, "device_busy_ms_per_step": device_us / 1e3,
            "top": [{"name": e.key, "calls": e.count,
                     "self_device_us_per_step": (getattr(e, "self_device_time_total", 0) or 0) / num_steps,
                     "self_cpu_us_per_step": e.self_cpu_time_total / num_steps}
                    for e in sorted(events, key=lambda e: -(getattr(e, "self_device_time_total", 0) or 0)
                                    - e.self_cpu_time_total * (0 if args.device.startswith("cuda") else 1))[:25]]}


# -- offline throughput ----------------------------------------------------------------------------------
def offline(args: argparse.Namespace) -> dict[str, Any]:
    from tandem import LLM

    model = "dummy:tiny" if args.dry_run else args.model
    num, prompt_len, max_tokens = (8, 32, 8) if args.dry_run else (args.num_requests, args.prompt_len,
                                                                   args.max_tokens)
    llm = LLM(model, device=args.device, max_model_len=prompt_len + max_tokens + 16, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = random_prompts(num, prompt_len, llm.config.model.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    sync(args.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    sync(args.device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return {"model": model, "num_requests": num, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "seconds": elapsed, "output_tokens": num_tokens, "output_tok_per_s": num_tokens / elapsed,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}


# -- HF transformers peers ---------------------------------------------------------------------------------
def hf_model(model: str, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    m = load_model_config(model, fetch=False)
    rope: dict[str, Any] = {"rope_type": m.rope.rope_type, "rope_theta": m.rope.theta}
    if m.rope.rope_type == "llama3":
        rope.update(factor=m.rope.factor, low_freq_factor=m.rope.low_freq_factor,
                    high_freq_factor=m.rope.high_freq_factor,
                    original_max_position_embeddings=m.rope.original_max_position_embeddings)
    config = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
                         max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps,
                         tie_word_embeddings=m.tie_word_embeddings, rope_parameters=rope)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        hf_model: Any = LlamaForCausalLM(config)
        return hf_model.to(dtype).eval()


def hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    model_name = "dummy:tiny" if args.dry_run else args.model
    num, prompt_len, max_tokens = (8, 32, 8) if args.dry_run else (args.num_requests, args.prompt_len,
                                                                   args.max_tokens)
    model = hf_model(model_name, args.device)
    prompts = random_prompts(num, prompt_len, model.config.vocab_size)
    result: dict[str, Any] = {"model": model_name, "mode": args.mode, "num_requests": num, "prompt_len": prompt_len,
                              "max_tokens": max_tokens}
    # generate_batch updates its cache in place outside inference mode; no_grad suits both.
    with torch.no_grad():
        if args.mode == "static":
            batch = args.hf_batch
            sync(args.device)
            start = time.perf_counter()
            for i in tqdm(range(0, num, batch), desc="hf static"):
                ids = torch.tensor(prompts[i:i + batch], device=args.device)
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            sync(args.device)
            result["batch_size"] = batch
        else:
            config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
            sync(args.device)
            start = time.perf_counter()
            outputs = model.generate_batch(inputs=prompts, generation_config=config)
            sync(args.device)
            generated = [len(o.generated_tokens) for o in outputs.values()]
            # Count what it really produced: a run that stopped early must not look fast.
            result["generated_tokens_per_request"] = sorted(set(generated))
            result["num_outputs"] = len(generated)
    elapsed = time.perf_counter() - start
    produced = num * max_tokens if args.mode == "static" else sum(generated)
    result.update(seconds=elapsed, output_tokens=produced, output_tok_per_s=produced / elapsed)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["correctness", "decode-latency", "offline", "hf", "profile"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, dummy:tiny, a few steps")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--models", default="dummy:llama-3.1-8b,dummy:llama-3.2-1b")
    parser.add_argument("--batches", default=None, help="decode-latency: 1,8,64,256 (1,64 with --fusions); "
                        "profile: its first")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--variants", choices=["main", "all"], default="all")
    parser.add_argument("--fusions", default=None,
                        help="decode-latency: compare these sets of fusions instead of the variants, each 'all', "
                             "'none' or names joined by '+' (rope_store, add_norm; opt-in attn_combine), the first "
                             "the baseline: e.g. none,rope_store,add_norm,all,all+attn_combine; writes "
                             "decode-latency-fusions.json. (Other commands: $TANDEM_FUSIONS.)")
    parser.add_argument("--logit-tolerance", type=float, default=0.25,
                        help="largest |logit difference| accepted between the bf16 kernel and reference paths")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--mode", choices=["static", "batch"], default="static")
    parser.add_argument("--quantization", default=None, help="profile: int8 or fp8 weights")
    parser.add_argument("--hf-batch", type=int, default=64)
    args = parser.parse_args()
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        import os

        # The Triton path on CPU needs the interpreter, chosen before triton is first imported.
        assert os.environ.get("TRITON_INTERPRET") == "1", "run the dry run with TRITON_INTERPRET=1"
    command = {"correctness": correctness, "decode-latency": decode_latency, "offline": offline, "hf": hf,
               "profile": profile}
    result = command[args.command](args)
    report = {"benchmark": args.command, "environment": environment(), "dry_run": args.dry_run,
              "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.mode}" if args.command == "hf" else ""
    if args.command == "decode-latency" and args.fusions:
        suffix = "-fusions"
    if args.command == "profile" and args.quantization:
        suffix = f"-{args.quantization}"
    (args.out / f"{args.command}{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(result, indent=1)[:3000])
    if "ablation" in result:
        print(json.dumps(result["ablation"], indent=1))


if __name__ == "__main__":
    main()

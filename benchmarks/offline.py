"""Offline throughput: tandem's engine against HF transformers' padded-batch `generate`, one run.

    python -m tandem.benchmarks.offline --out benchmarks/results/offline-cpu.json

16 prompts of 32-255 random tokens, 64 output tokens each (greedy, EOS ignored so every system
generates exactly the same number of tokens), on SmolLM2-135M. Prints output tokens/s of each and
the ratio; writes JSON with the machine and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

import tandem
from tandem import LLM, SamplingParams
from tandem.models import load_model_config


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 3.. avoid SmolLM2's special tokens; all prompts are valid for any vocabulary >= 49152.
    return [[rng.randrange(3, min(vocab_size, 49152)) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


def run_tandem(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": num_tokens, "output_tok_per_s": num_tokens / elapsed}


def load_hf(folder: str, device: str) -> Any:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


def run_hf(model: Any, prompts: list[list[int]], max_tokens: int, device: str) -> dict[str, float]:
    pad_id = 2
    width = max(len(p) for p in prompts)
    # Left padding, so every row's next token follows its own last prompt token.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        elapsed = time.perf_counter() - start
    num_tokens = (out.shape[1] - width) * len(prompts)
    return {"seconds": elapsed, "output_tokens": num_tokens, "output_tok_per_s": num_tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=255)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each system, interleaved; median reported")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_model_config(args.model)
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, config.vocab_size, seed=0)
    # Both systems stay loaded and take turns, `--repeat` times each; the median run of each is
    # reported, so a noisy neighbour on a shared machine does not decide the ratio.
    llm = LLM(args.model, device=args.device, max_model_len=1024, max_num_batched_tokens=4096)
    warm = [p[:8] for p in prompts[:2]]
    run_tandem(llm, warm, 4)
    systems: list[tuple[str, Any]] = [("tandem", lambda: run_tandem(llm, prompts, args.max_tokens))]
    if config.weights_path is not None:
        hf_model = load_hf(config.weights_path, args.device)
        run_hf(hf_model, warm, 4, args.device)
        systems.append(("hf_generate_padded", lambda: run_hf(hf_model, prompts, args.max_tokens, args.device)))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in systems}
    with tqdm(total=args.repeat * len(systems), desc="runs") as bar:
        for _ in range(args.repeat):
            for name, run in systems:
                runs[name].append(run())
                bar.update()
    results: dict[str, dict[str, Any]] = {
        name: sorted(r, key=lambda x: x["seconds"])[len(r) // 2] | {"all_seconds": [x["seconds"] for x in r]}
               for name, r in runs.items()}
    report: dict[str, Any] = {
        "benchmark": "offline",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": torch.get_num_threads(), "device": args.device},
        "versions": {"tandem": tandem.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "workload": {"repeat": args.repeat, "model": args.model, "num_prompts": args.num_prompts,
                     "prompt_tokens": [len(p) for p in prompts], "max_tokens": args.max_tokens},
        "results": results,
    }
    if "hf_generate_padded" in results:
        report["ratio_tandem_over_hf"] = (results["tandem"]["output_tok_per_s"]
                                          / results["hf_generate_padded"]["output_tok_per_s"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'system':<22}{'seconds':>10}{'out tok/s':>12}")
    for name, r in results.items():
        print(f"{name:<22}{r['seconds']:>10.2f}{r['output_tok_per_s']:>12.1f}")
    if "ratio_tandem_over_hf" in report:
        print(f"tandem / HF = {report['ratio_tandem_over_hf']:.2f}x")


if __name__ == "__main__":
    main()

"""Speculative decoding, wall clock: the same prompts with and without speculation (n-gram prompt lookup, or a
draft model), at several batch sizes.

    python -m tandem.benchmarks.spec_speed --model smollm2-135m --device cpu --max-tokens 128 \\
        --out benchmarks/results/cpu-2026-12-01/spec-speed.json
    python -m tandem.benchmarks.spec_speed --model smollm2-135m --draft-model smollm2-135m --out /tmp/draft.json
    python -m tandem.benchmarks.spec_speed --device cuda --model dummy:llama-3.1-8b \\
        --draft-model dummy:llama-3.1-8b --batch-sizes 1,16 --prompts all --out $OUT/spec-speed-draft.json

The prompts are `spec_acceptance`'s: input-grounded ones (repeat, correct or summarise a given text, edit code)
and open chat, through the model's chat template (for a model without a tokenizer, seeded random token ids of
the same lengths). Greedy, so both runs must give the same tokens: checked on the CPU (float32), reported as
`identical` elsewhere (bfloat16 verify and decode kernels may round a near-tie differently). A `dummy:` model
ignores EOS (every request runs to max_tokens). Reported per prompt set and batch size: output tokens per second
with and without speculation and their ratio, target forwards (engine steps) per output token, acceptance
(accepted / proposed) and, with a draft model, the tokens the draft computed. Each engine is warmed up first;
runs alternate (plain, spec, plain, spec, ...) and the medians are kept. A draft equal to the target (same name)
is the mechanical ceiling: every greedy proposal is accepted, so the speed-up left is what the machinery costs
against what reading the weights once per K + 1 tokens saves (the draft reads them K times too).

`--dry-run` runs the same code on tiny shapes (dummy:tiny, 2 prompts per set, 8 tokens) to check it before a
GPU run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem import LLM, SamplingParams
from tandem.benchmarks.spec_acceptance import GROUNDED, OPEN
from tandem.engine.engine import Engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPT_SETS = {"grounded": GROUNDED, "open": OPEN, "all": GROUNDED + OPEN}


def speculative_config(draft_model: str | None, k: int, disable_by_batch_size: int | None = None) -> dict[str, Any]:
    extra = {} if disable_by_batch_size is None else {"disable_by_batch_size": disable_by_batch_size}
    return _speculative_config(draft_model, k) | extra


def _speculative_config(draft_model: str | None, k: int) -> dict[str, Any]:
    if draft_model is None:
        return NGRAM | {"num_speculative_tokens": k}
    return {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k}


def prompt_ids(llm: LLM, texts: list[str]) -> list[list[int]]:
    """Each text as a one-turn chat through the model's template; seeded random ids (~4 characters a token) for a
    model without a tokenizer."""
    if llm.tokenizer is not None:
        from tandem.models import apply_chat_template

        return [apply_chat_template(llm.tokenizer, [{"role": "user", "content": text}]) for text in texts]
    rng = random.Random(0)
    vocab = llm.config.model.vocab_size
    return [[rng.randrange(2, vocab) for _ in range(max(8, len(text) // 4))] for text in texts]


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """All prompts at once through the engine (no detokenizer): seconds, tokens, engine steps (target forwards),
    proposals, acceptances and draft-model tokens."""
    steps = drafted = accepted = draft_tokens = 0
    requests = [engine.add_request(f"bench-{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    while engine.has_unfinished():
        result = engine.step()
        steps += bool(result.requests)
        drafted += result.num_draft_tokens
        accepted += result.num_accepted_tokens
        draft_tokens += result.num_draft_model_tokens
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [r.output_token_ids for r in requests], "steps": steps,
            "drafted": drafted, "accepted": accepted, "draft_model_tokens": draft_tokens}


def run(engine: Engine, prompts: list[list[int]], batch: int, params: SamplingParams) -> dict[str, Any]:
    """The prompts `batch` at a time, each batch to its end: totals over the batches."""
    total: dict[str, Any] = {"seconds": 0.0, "tokens": [], "steps": 0, "drafted": 0, "accepted": 0,
                             "draft_model_tokens": 0}
    for i in range(0, len(prompts), batch):
        part = generate(engine, prompts[i:i + batch], params)
        for key, value in part.items():
            total[key] += value
    total["output_tokens"] = sum(len(t) for t in total["tokens"])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft-model", default=None,
                        help="speculate with this draft model (same vocabulary) instead of n-gram prompt lookup")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="speculative_config's disable_by_batch_size (default: always speculate)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--batch-sizes", "--batches", dest="batch_sizes", default="1,8")
    parser.add_argument("--prompts", default="grounded,open",
                        help="prompt sets: grounded, open (8 each), all (the 16 together)")
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N of each set (all by default)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks per engine; on a GPU by default what the largest batch needs (both "
                             "engines live in one process)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, to check the script")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    model, draft_model, max_tokens, max_model_len = args.model, args.draft_model, args.max_tokens, args.max_model_len
    num_prompts = args.num_prompts
    if args.dry_run:
        model, max_tokens, max_model_len, num_prompts = "dummy:tiny", 8, 512, 2
        draft_model = "dummy:tiny" if draft_model is not None else None
    batches = [int(b) for b in args.batch_sizes.split(",")]
    spec = speculative_config(draft_model, args.num_speculative_tokens, args.disable_by_batch_size)
    num_kv_blocks = args.num_kv_blocks
    if num_kv_blocks is None and args.device.startswith("cuda"):
        num_kv_blocks = max(batches) * math.ceil(max_model_len / 16) + 64
    common: dict[str, Any] = {"device": args.device, "max_model_len": max_model_len, "max_num_seqs": max(batches),
                              "num_kv_blocks": num_kv_blocks}
    is_dummy = model.startswith("dummy:")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=is_dummy)
    plain = LLM(model, **common)
    speculative = LLM(model, speculative_config=spec, **common)
    engines = {"plain": plain.engine, "spec": speculative.engine}
    for engine in engines.values():
        engine.warm_up()
    rows = []
    for kind in args.prompts.split(","):
        texts = PROMPT_SETS[kind][:num_prompts]
        prompts = prompt_ids(plain, texts)
        for batch in batches:
            runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
            for _ in range(args.repeat):
                for name, engine in engines.items():
                    runs[name].append(run(engine, prompts, batch, params))
            plain_run, spec_run = runs["plain"][0], runs["spec"][0]
            identical = sum(a == b for a, b in zip(plain_run["tokens"], spec_run["tokens"], strict=True))
            if args.device == "cpu":
                assert identical == len(prompts), "speculation changed the output"
            secs = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
            num_tokens = spec_run["output_tokens"]
            rows.append({
                "prompts": kind, "batch": batch, "output_tokens": num_tokens,
                "plain_tok_per_s": plain_run["output_tokens"] / secs["plain"],
                "spec_tok_per_s": num_tokens / secs["spec"], "speedup": secs["plain"] / secs["spec"],
                "tokens_per_forward_per_request": num_tokens / spec_run["steps"] / min(batch, len(prompts)),
                "acceptance": spec_run["accepted"] / max(1, spec_run["drafted"]), "drafted": spec_run["drafted"],
                "accepted": spec_run["accepted"], "plain_steps": plain_run["steps"], "spec_steps": spec_run["steps"],
                "draft_model_tokens": spec_run["draft_model_tokens"], "identical": f"{identical}/{len(prompts)}",
                "seconds": {name: [r["seconds"] for r in rs] for name, rs in runs.items()}})
    report = {"benchmark": "spec_speed", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": model, "draft_model": draft_model, "device": args.device, "dry_run": args.dry_run,
              "speculative_config": spec, "max_tokens": max_tokens, "max_model_len": max_model_len,
              "num_kv_blocks": plain.engine.num_total_blocks, "ignore_eos": is_dummy,
              "versions": {"tandem": tandem.__version__, "torch": torch.__version__},
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "threads": torch.get_num_threads(), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'prompts':<9} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'steps plain/spec':>17} "
          f"{'acceptance':>11} {'tok/fwd':>8} {'identical':>10}")
    for r in rows:
        print(f"{r['prompts']:<9} {r['batch']:>5} {r['plain_tok_per_s']:>12.1f} {r['spec_tok_per_s']:>11.1f} "
              f"{r['speedup']:>8.2f} {r['plain_steps']:>8}/{r['spec_steps']:<8} {r['acceptance']:>11.2f} "
              f"{r['tokens_per_forward_per_request']:>8.2f} {r['identical']:>10}")


if __name__ == "__main__":
    main()

"""Speculative decoding, wall clock: the same chats with and without n-gram speculation, batch 1 and batch 8.

    python -m tandem.benchmarks.spec_speed --model smollm2-135m --device cpu --max-tokens 128 \\
        --out benchmarks/results/cpu-2026-12-01/spec-speed.json

The prompts are `spec_acceptance`'s: input-grounded ones (repeat, correct or summarise a given text, edit code)
and open chat. Greedy, so both runs must give the same tokens (checked). Reported per prompt set and batch size:
output tokens per second with and without speculation and their ratio, target forwards (engine steps) per output
token, acceptance (accepted / proposed). Runs alternate (plain, spec, plain, spec, ...) and the medians are kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem import LLM, SamplingParams
from tandem.benchmarks.spec_acceptance import GROUNDED, OPEN

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(llm: LLM, chats: list[list[dict[str, str]]], batch: int, params: SamplingParams) -> dict[str, Any]:
    """Generate every chat, `batch` at a time: seconds, tokens, engine steps, proposals and acceptances."""
    steps = drafted = accepted = 0
    step = llm.engine.step

    def counted():  # type: ignore[no-untyped-def]
        nonlocal steps, drafted, accepted
        result = step()
        if result.requests:
            steps += 1
        drafted += result.num_draft_tokens
        accepted += result.num_accepted_tokens
        return result

    llm.engine.step = counted  # type: ignore[method-assign]
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(chats), batch):
        tokens += [o.token_ids for o in llm.chat(chats[i:i + batch], params)]
    seconds = time.perf_counter() - start
    llm.engine.step = step  # type: ignore[method-assign]
    num_tokens = sum(len(t) for t in tokens)
    return {"seconds": seconds, "tokens": tokens, "output_tokens": num_tokens, "steps": steps,
            "drafted": drafted, "accepted": accepted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    plain = LLM(args.model, device=args.device, max_model_len=2048)
    spec = LLM(args.model, device=args.device, max_model_len=2048, speculative_config=SPEC)
    rows = []
    for kind, texts in (("grounded", GROUNDED), ("open", OPEN)):
        chats = [[{"role": "user", "content": text}] for text in texts]
        for batch in (int(b) for b in args.batches.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
            for _ in range(args.repeat):
                runs["plain"].append(run(plain, chats, batch, params))
                runs["spec"].append(run(spec, chats, batch, params))
            assert runs["plain"][0]["tokens"] == runs["spec"][0]["tokens"], "speculation changed the output"
            secs = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
            s = runs["spec"][0]
            num_tokens = s["output_tokens"]
            rows.append({"prompts": kind, "batch": batch, "output_tokens": num_tokens,
                         "plain_tok_per_s": num_tokens / secs["plain"], "spec_tok_per_s": num_tokens / secs["spec"],
                         "speedup": secs["plain"] / secs["spec"],
                         "tokens_per_forward_per_request": num_tokens / s["steps"] / min(batch, len(chats)),
                         "acceptance": s["accepted"] / max(1, s["drafted"]), "drafted": s["drafted"],
                         "accepted": s["accepted"], "plain_steps": runs["plain"][0]["steps"], "spec_steps": s["steps"]})
    report = {"benchmark": "spec_speed", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "device": args.device, "speculative_config": SPEC, "max_tokens": args.max_tokens,
              "versions": {"tandem": tandem.__version__, "torch": torch.__version__},
              "threads": torch.get_num_threads(), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'prompts':<9} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'steps plain/spec':>17} "
          f"{'acceptance':>11}")
    for r in rows:
        print(f"{r['prompts']:<9} {r['batch']:>5} {r['plain_tok_per_s']:>12.1f} {r['spec_tok_per_s']:>11.1f} "
              f"{r['speedup']:>8.2f} {r['plain_steps']:>8}/{r['spec_steps']:<8} {r['acceptance']:>11.2f}")


if __name__ == "__main__":
    main()

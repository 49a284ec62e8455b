"""Offline acceptance of the n-gram (prompt lookup) proposer on real generations, no speculative engine needed.

    python -m tandem.benchmarks.spec_acceptance --out /tmp/spec.json

Generates greedily with `tandem.LLM` for chat prompts of two kinds, input-grounded (repeat, correct, summarise
or answer from a given text; edit given code) and open (no text to copy from), then replays each generated
sequence step by step as a speculative engine would run it: the proposer sees prompt + output so far, the
verify step accepts the longest prefix of its proposal equal to the continuation and emits one more token.
For greedy requests this is exact, because verification accepts a proposal iff it equals the greedy token
(`tandem.engine.spec_decode.verify`), so replaying the non-speculative output gives the speculative run.
Reports, per kind and K: acceptance rate (accepted / proposed tokens), mean tokens per target forward (decode
steps only: the first token comes from the prefill), and how often a step had any proposal at all.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem import LLM, SamplingParams
from tandem.engine.ngram import NgramProposer

ESSAY = (
    "The Great Barrier Reef is the world's largest coral reef system, made up of over 2,900 individual reefs "
    "and 900 islands stretching for over 2,300 kilometres off the coast of Queensland, Australia. It can be "
    "seen from outer space and is the world's biggest single structure made by living organisms. The reef is "
    "built by billions of tiny organisms known as coral polyps. It supports a wide diversity of life and was "
    "selected as a World Heritage Site in 1981. Climate change, pollution and fishing threaten its health."
)
TYPOS = ("Yesterday I goes to the libary to borow a book about astronmy. The librarian were very helpfull and "
         "she show me were the science section is. I finded three intresting books and chose the one with the "
         "most pictures, becuase I wanted to lern about planets.")
CODE = '''def average(xs):
    s = 0
    for x in xs:
        s = s + x
    return s / len(xs)


def count_words(text):
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
'''
JS = '''function greet(name) {
  const message = "Hello, " + name + "!";
  console.log(message);
  return message;
}
'''

GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{ESSAY}",
    f"Correct the spelling and grammar mistakes in this paragraph and write out the corrected paragraph:\n\n{TYPOS}",
    f"Summarise the following text in three sentences:\n\n{ESSAY}",
    f"Read the text and answer: how many islands are part of the reef, and when did it become a World Heritage "
    f"Site?\n\n{ESSAY}",
    f"Rename the function `average` to `mean` and the variable `s` to `total` in this Python code. Reply with the "
    f"full updated code.\n\n```python\n{CODE}```",
    f"Add a docstring and type hints to each function in this Python code. Reply with the full code.\n\n"
    f"```python\n{CODE}```",
    f"Rewrite this JavaScript function to use a template literal instead of string concatenation. Reply with the "
    f"full function.\n\n```javascript\n{JS}```",
    f"Rewrite the following text as a bulleted list of facts:\n\n{ESSAY}",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "Explain how a hash table works.",
    "Give me three ideas for a child's birthday party.",
    "Write a haiku about GPUs.",
    "Why is the sky blue?",
    "How do I make a good cup of tea?",
    "Describe the water cycle to a ten-year-old.",
]


@dataclass
class Tally:
    num_steps: int = 0  # target forwards (verify steps) after the prefill
    num_steps_with_proposal: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0

    def add(self, other: Tally) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def summary(self) -> dict[str, float | int]:
        return asdict(self) | {
            "acceptance_rate": self.num_accepted / max(self.num_proposed, 1),
            "tokens_per_forward": self.num_emitted / max(self.num_steps, 1),
            "proposal_rate": self.num_steps_with_proposal / max(self.num_steps, 1),
        }


def replay(prompts: list[list[int]], outputs: list[list[int]], proposer: NgramProposer,
           max_tokens: int) -> list[Tally]:
    """Speculative decoding of the known greedy outputs, all sequences batched as an engine would step them."""
    tallies = [Tally() for _ in prompts]
    done = [1] * len(prompts)  # the prefill emitted each first token
    active = [s for s, out in enumerate(outputs) if len(out) > 1]
    while active:
        proposals = proposer.propose([prompts[s] + outputs[s][:done[s]] for s in active])
        for s, proposal in zip(active, proposals, strict=True):
            # As the scheduler would: a run emits len(proposal) + 1 tokens at most, never past max_tokens.
            proposal = proposal[:max_tokens - done[s] - 1]
            rest = outputs[s][done[s]:]
            num_accepted = 0
            while num_accepted < min(len(proposal), len(rest)) and proposal[num_accepted] == rest[num_accepted]:
                num_accepted += 1
            # A run that accepts the final token (EOS) ends there: what follows it is dropped.
            num_emitted = min(num_accepted + 1, len(rest))
            tally = tallies[s]
            tally.num_steps += 1
            tally.num_steps_with_proposal += bool(proposal)
            tally.num_proposed += len(proposal)
            tally.num_accepted += min(num_accepted, num_emitted)
            tally.num_emitted += num_emitted
            done[s] += num_emitted
        active = [s for s in active if done[s] < len(outputs[s])]
    return tallies


def generate(model: str, device: str, max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    """Greedy chat replies to every prompt, and the seconds they took."""
    llm = LLM(model, device=device, max_model_len=2048, max_num_batched_tokens=4096)
    kinds = ["grounded"] * len(GROUNDED) + ["open"] * len(OPEN)
    conversations = [[{"role": "user", "content": text}] for text in GROUNDED + OPEN]
    start = time.perf_counter()
    generated = llm.chat(conversations, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    seconds = time.perf_counter() - start
    return [{"kind": kind, "finish_reason": g.finish_reason, "text": g.text, "prompt_token_ids": g.prompt_token_ids,
             "token_ids": g.token_ids} for kind, g in zip(kinds, generated, strict=True)], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--replay", type=Path, default=None,
                        help="reuse the sequences of an earlier run's JSON instead of generating (other settings)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    if args.replay:
        earlier = json.loads(args.replay.read_text())
        sequences, generate_seconds = earlier["sequences"], earlier["workload"]["generate_seconds"]
        args.model, args.max_tokens = earlier["workload"]["model"], earlier["workload"]["max_tokens"]
    else:
        sequences, generate_seconds = generate(args.model, args.device, args.max_tokens)
    kinds = [seq["kind"] for seq in sequences]
    prompts = [seq["prompt_token_ids"] for seq in sequences]
    outputs = [seq["token_ids"] for seq in sequences]

    results: dict[str, dict[str, Any]] = {}
    for k in args.num_speculative_tokens:
        proposer = NgramProposer(k, args.prompt_lookup_min, args.prompt_lookup_max)
        tallies = replay(prompts, outputs, proposer, args.max_tokens)
        for kind in ("grounded", "open", "all"):
            total = Tally()
            for tally, tally_kind in zip(tallies, kinds, strict=True):
                if kind in ("all", tally_kind):
                    total.add(tally)
            results.setdefault(kind, {})[str(k)] = total.summary()

    report: dict[str, Any] = {
        "benchmark": "spec_acceptance",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "device": args.device},
        "versions": {"tandem": tandem.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "workload": {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0,
                     "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
                     "generate_seconds": generate_seconds},
        "results": results,
        "sequences": sequences,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"n-gram proposer, prompt_lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, {args.model} greedy, "
          f"{sum(len(o) for o in outputs)} output tokens")
    print(f"{'kind':<10}{'K':>3}{'accept rate':>13}{'tok/forward':>13}{'proposed in':>13}")
    for kind, by_k in results.items():
        for k_name, r in by_k.items():
            print(f"{kind:<10}{k_name:>3}{r['acceptance_rate']:>13.2f}{r['tokens_per_forward']:>13.2f}"
                  f"{r['proposal_rate']:>12.0%}")


if __name__ == "__main__":
    main()

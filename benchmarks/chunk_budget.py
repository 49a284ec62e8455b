"""How long a mixed step takes against a decode step, by prompt-chunk size: the measure behind the default token
budget of chunked prefill (`max_num_batched_tokens`).

    python -m tandem.benchmarks.chunk_budget --model smollm2-135m --device cpu --decode-batch 16 \\
        --chunks 32,64,128,256,512 --out chunk-budget.json

One engine runs `--decode-batch` requests that are decoding, then, per chunk size C, steps made of those decode
tokens plus a C-token chunk of a long prompt (what a step with budget decode_batch + C looks like while a long
prompt arrives). Reported: the pure decode step, each mixed step, and their ratio; inter-token latency p99 under
a stream of long prompts is about that ratio times the decode step, so the budget is the largest chunk whose
ratio stays within the target (2.5x in issue #16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import tandem
from tandem.common.config import EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.models import load_model_config


def _timed_step(engine: Engine) -> float:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding request")
    parser.add_argument("--chunks", default="32,64,128,256,512")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    chunks = [int(c) for c in args.chunks.split(",")]
    long_prompt = max(chunks) * (args.repeat + 2)
    config = EngineConfig.create(load_model_config(args.model), device=args.device,
                                 max_model_len=long_prompt + 64, max_num_seqs=args.decode_batch + 1,
                                 max_num_batched_tokens=args.decode_batch * args.context)
    engine = Engine(config)
    engine.warm_up()
    vocab = config.model.vocab_size
    params = SamplingParams(max_tokens=long_prompt + 64 - args.context, temperature=0.0, ignore_eos=True, seed=0)
    for i in range(args.decode_batch):
        engine.add_request(f"d{i}", [(13 * i + 7 * j) % (vocab - 10) + 5 for j in range(args.context)], params)
    while any(r.is_prefilling or r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()  # every decoding request prefilled, in one or more steps
    decode_s = statistics.median(_timed_step(engine) for _ in range(args.repeat * 2))
    rows = []
    scheduler = engine.scheduler
    for chunk in chunks:
        scheduler.config = type(scheduler.config)(max_num_seqs=scheduler.config.max_num_seqs,
                                                  max_num_batched_tokens=args.decode_batch + chunk)
        engine.add_request(f"long-{chunk}", [(3 * j) % (vocab - 10) + 5 for j in range(long_prompt)],
                           SamplingParams(max_tokens=1, temperature=0.0, seed=0))
        times = [_timed_step(engine) for _ in range(args.repeat)]
        engine.abort(f"long-{chunk}")
        mixed_s = statistics.median(times)
        rows.append({"chunk": chunk, "mixed_step_s": mixed_s, "ratio_to_decode": mixed_s / decode_s})
    report = {"benchmark": "chunk_budget", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "device": args.device, "decode_batch": args.decode_batch, "context": args.context,
              "versions": {"tandem": tandem.__version__, "torch": torch.__version__},
              "threads": torch.get_num_threads(),
              "decode_step_s": decode_s, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"decode step (batch {args.decode_batch}): {decode_s * 1e3:.1f} ms")
    print(f"{'chunk':>6} {'mixed step ms':>14} {'x decode':>9}")
    for row in rows:
        print(f"{row['chunk']:>6} {row['mixed_step_s'] * 1e3:>14.1f} {row['ratio_to_decode']:>9.2f}")


if __name__ == "__main__":
    main()

"""What building a worker's model costs: time, peak and steady memory, each measurement in a fresh process.

    python -m tandem.benchmarks.startup --models smollm2-135m,dummy:llama-3.2-1b --dtypes auto,bfloat16 \
        --repeat 2 --out startup.json

Each run builds a `ModelRunner` (the model in its dtype, its weights, on the CPU the oneDNN packing, a small KV
pool) in a new Python process and reports the seconds it took, the process's peak RSS (every page it ever
touched, so a transient copy shows), its RSS after the build, and on CUDA the allocator's peak and held bytes.
CUDA graphs are not captured (`use_cuda_graphs` off): this is the weights' part of a start-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tandem.benchmarks.gpu_engine import environment

_MEASURE = """
import json, resource, sys, time, torch
from tandem.common.config import EngineConfig
from tandem.engine.runner import ModelRunner
from tandem.models import load_model_config
model, dtype, device = sys.argv[1:4]
config = load_model_config(model)
start = time.perf_counter()
runner = ModelRunner(EngineConfig.create(config, device=device, dtype=dtype, max_model_len=256, num_kv_blocks=64,
                                         use_cuda_graphs=False))
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
out = {"seconds": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "rss_bytes": rss, "dtype": str(runner.dtype).removeprefix("torch.")}
if device.startswith("cuda"):
    out |= {"cuda_peak_bytes": torch.cuda.max_memory_allocated(), "cuda_allocated_bytes": torch.cuda.memory_allocated()}
print(json.dumps(out))
"""


def measure(model: str, dtype: str, device: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _MEASURE, model, dtype, device], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{model} {dtype}: {done.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,dummy:llama-3.2-1b")
    parser.add_argument("--dtypes", default="auto,bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [(m, d) for m in args.models.split(",") for d in args.dtypes.split(",")]
    rows = []
    with tqdm(total=len(cases) * args.repeat, desc="builds", unit="build") as bar:
        for model, dtype in cases:
            runs = []
            for _ in range(args.repeat):
                runs.append(measure(model, dtype, args.device))
                bar.update()
            rows.append({"model": model, "dtype": runs[0]["dtype"], "runs": runs,
                         "seconds": statistics.median(r["seconds"] for r in runs),
                         "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
                         "rss_bytes": statistics.median(r["rss_bytes"] for r in runs)})
    report = {"benchmark": "startup", "device": args.device, "command": " ".join(sys.argv), **environment(),
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(f"{'model':<22} {'dtype':<9} {'build s':>8} {'peak RSS GiB':>13} {'RSS GiB':>8}")
    for row in rows:
        print(f"{row['model']:<22} {row['dtype']:<9} {row['seconds']:>8.2f} {row['peak_rss_bytes'] / 2**30:>13.2f} "
              f"{row['rss_bytes'] / 2**30:>8.2f}")


if __name__ == "__main__":
    main()

"""Plot decode step latency against the HBM floor from a `gpu_engine decode-latency` JSON.

    python -m tandem.benchmarks.plot_decode benchmarks/results/h200-2026-11-29/decode-latency.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    path = Path(sys.argv[1])
    rows = json.loads(path.read_text())["result"]["rows"]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for variant in ("triton+graphs", "triton eager", "torch eager"):
            points = sorted((r["batch"], r["step_ms"]) for r in rows if r["model"] == model and r["variant"] == variant)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=variant)
        floor = sorted((r["batch"], r["floor_ms"]) for r in rows
                       if r["model"] == model and r["variant"] == "triton+graphs")
        ax.plot(*zip(*floor, strict=True), linestyle="--", color="black", label="HBM floor (4.25 TB/s)")
        ax.set(xscale="log", yscale="log", xlabel="batch size (context 1024)", ylabel="decode step (ms)",
               title=model)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()

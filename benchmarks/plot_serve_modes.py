"""One PNG comparing deployment modes from `serve_modes` JSON files: TTFT p50, ITL p99 and goodput per rate.

    python -m tandem.benchmarks.plot_serve_modes serve-colocated.json serve-disagg.json serve-split-60.json \\
        --out serve-modes.png [--labels "colocated,disaggregated,MPS 60/40"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--labels", help="comma-separated, one per file (default: each file's mode)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.loads(path.read_text()) for path in args.files]
    labels = args.labels.split(",") if args.labels else [report["mode"] for report in reports]
    if len(labels) != len(reports):
        parser.error(f"--labels: {len(labels)} labels for {len(reports)} files")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("TTFT p50 (ms)", lambda r: r["ttft_s"]["p50"] * 1e3),
              ("inter-token latency p99 (ms)", lambda r: r["itl_s"]["p99"] * 1e3),
              ("goodput (req/s, TTFT ≤ 200 ms, TPOT ≤ 50 ms)", lambda r: r["goodput_rps"]))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for report, label in zip(reports, labels, strict=True):
            rates = [r["rate"] for r in report["results"]]
            ax.plot(rates, [value(r) for r in report["results"]], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend()
    first = reports[0]
    fig.suptitle(f"{first['model']}, {first['prompt_len']} prompt / {first['output_len']} output tokens, "
                 f"{first['num_requests']} requests per rate, one GPU", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()

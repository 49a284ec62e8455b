"""Plot the stack's output tokens/s as a share of the engine's, one bar per `stack_overhead` JSON (with the
gateway's CPU per output token and its number of processes, where the JSON has them).

    python -m tandem.benchmarks.plot_stack_overhead OUT.png A.json B.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, paths = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    reports = [json.loads(p.read_text()) for p in paths]
    labels = [r["label"] or p.stem for r, p in zip(reports, paths, strict=True)]
    shares = [100 * r["stack_share_of_engine"] for r in reports]
    # Each run's own ratio (runs interleave engine and stack), to show the spread behind the median.
    runs = [[100 * s["output_tok_per_s"] / e["output_tok_per_s"] for e, s in zip(r["engine"], r["stack"], strict=True)]
            for r in reports]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.barh(range(len(reports)), shares, color="tab:blue", alpha=0.7)
    for i, values in enumerate(runs):
        ax.plot(values, [i] * len(values), "k.", label="single runs" if i == 0 else None)
        gateway = ""
        if reports[i].get("gateway_cpu_us_per_output_token") is not None:
            gateway = (f"  gateway {reports[i]['gateway_cpu_us_per_output_token']:.0f} µs/token, "
                       f"×{reports[i].get('gateway_workers', 1)}")
        ax.text(max(values + [shares[i]]) + 1.5, i, f"{shares[i]:.0f}%{gateway}", va="center", fontsize=8)
    ax.axvline(90, color="tab:red", linestyle="--", label="target on a GPU (90%)")
    ax.set(yticks=range(len(reports)), yticklabels=labels, xlim=(0, 140),
           xlabel="stack output tok/s, % of the offline engine's", title=reports[0]["args"]["model"] + " on "
           + reports[0]["args"]["device"] + f", {reports[0]['args']['num_requests']} requests in one burst")
    ax.title.set_fontsize(10)
    ax.invert_yaxis()
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()

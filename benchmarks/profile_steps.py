"""What the GPU did during each profiled engine step, from the files `TANDEM_PROFILE_STEPS` writes.

    TANDEM_PROFILE_STEPS=prefill:1-20,decode:1-300 TANDEM_PROFILE_DIR=/tmp/prof tandem up ...
    python -m tandem.benchmarks.profile_steps /tmp/prof --out profile-steps.json

For each `<role>-<pid>.trace.json.gz` beside its `.steps.json`: per step, its wall time (the engine thread's), the
GPU time of the kernels launched inside it (the union of their intervals, so overlapping streams count once),
the share of the wall the GPU was busy, the kernels' count, and the longest host operations inside it. A step
whose GPU share is low waited on the host: Python between launches, a lock, the GIL held by another thread.
A table of the slowest steps per worker last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def summarize(trace_path: Path, steps_path: Path, top_ops: int = 3) -> dict[str, Any]:
    """One worker's profiled steps (see the module's docstring)."""
    meta = json.loads(steps_path.read_text())
    events = json.loads(gzip.decompress(trace_path.read_bytes()))["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    prefix = f"{meta['role']} step "
    windows = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"][len(prefix):])) for e in complete
                     if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix))
    # Launches (CPU side) name the kernel they start by correlation id; a kernel belongs to the step that launched it.
    launched_at = {e["args"]["correlation"]: e["ts"] for e in complete
                   if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = [e for e in complete if e.get("cat") in GPU_CATEGORIES]
    host = [e for e in complete if e.get("cat") == "cpu_op"]
    by_step: dict[int, dict[str, Any]] = {number: {"kernels": [], "ops": []} for _, _, number in windows}
    starts = [w[0] for w in windows]

    def step_at(ts: float) -> int | None:
        lo, hi = 0, len(windows)
        while lo < hi:
            mid = (lo + hi) // 2
            if starts[mid] <= ts:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        start, stop, number = windows[lo - 1]
        return number if ts <= stop else None

    for e in gpu:
        at = launched_at.get(e.get("args", {}).get("correlation"), e["ts"])
        number = step_at(at)
        if number is not None:
            by_step[number]["kernels"].append((e["ts"], e["ts"] + e["dur"]))
    for e in host:
        number = step_at(e["ts"])
        if number is not None:
            by_step[number]["ops"].append((e["dur"], e["name"]))
    rows = []
    for record in meta["steps"]:
        found = by_step.get(record["step"], {"kernels": [], "ops": []})
        gpu_ms = _union_ms(found["kernels"])
        ops = sorted(found["ops"], reverse=True)[:top_ops]
        rows.append({**record, "gpu_ms": round(gpu_ms, 3), "num_kernels": len(found["kernels"]),
                     "gpu_share": round(gpu_ms / record["wall_ms"], 3) if record["wall_ms"] else None,
                     "longest_ops": [{"name": name, "ms": round(dur / 1e3, 3)} for dur, name in ops]})
    walls = [r["wall_ms"] for r in rows]
    shares = [r["gpu_share"] for r in rows if r["gpu_share"] is not None]
    return {"role": meta["role"], "pid": meta["pid"], "trace": trace_path.name, "num_steps": len(rows),
            "wall_ms_total": round(sum(walls), 3), "gpu_ms_total": round(sum(r["gpu_ms"] for r in rows), 3),
            "wall_ms_p50": round(statistics.median(walls), 3) if walls else None,
            "gpu_share_p50": round(statistics.median(shares), 3) if shares else None, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="TANDEM_PROFILE_DIR of the run")
    parser.add_argument("--slowest", type=int, default=8, help="steps per worker in the table")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workers = []
    for steps_path in sorted(args.folder.glob("*.steps.json")):
        trace = steps_path.with_name(steps_path.name.replace(".steps.json", ".trace.json.gz"))
        workers.append(summarize(trace, steps_path))
    if not workers:
        raise SystemExit(f"no <role>-<pid>.steps.json under {args.folder}")
    if args.out:
        args.out.write_text(json.dumps({"workers": workers}, indent=1) + "\n")
    for worker in workers:
        print(f"\n{worker['role']} pid {worker['pid']}: {worker['num_steps']} steps, wall {worker['wall_ms_total']:.1f}"
              f" ms, GPU {worker['gpu_ms_total']:.1f} ms, median step {worker['wall_ms_p50']} ms at GPU share"
              f" {worker['gpu_share_p50']}")
        print(f"{'step':>5} {'wall ms':>9} {'gpu ms':>8} {'share':>6} {'tokens':>7} {'batch':>6}  longest host ops")
        for row in sorted(worker["steps"], key=lambda r: -r["wall_ms"])[:args.slowest]:
            ops = ", ".join(f"{op['name'][:40]} {op['ms']:.1f}" for op in row["longest_ops"])
            print(f"{row['step']:>5} {row['wall_ms']:>9.2f} {row['gpu_ms']:>8.2f} {row['gpu_share'] or 0:>6.2f}"
                  f" {row['num_tokens']:>7} {row['batch_size']:>6}  {ops}")


if __name__ == "__main__":
    main()

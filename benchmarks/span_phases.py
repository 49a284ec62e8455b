"""Where a request's time to first token goes, from the spans the services export.

    OTEL_TRACES_EXPORTER=console python -m tandem.benchmarks.serve_modes ...   # spans into the service logs
    python -m tandem.benchmarks.span_phases $TANDEM_HOME/logs/<run> --out phases.json

Reads every span the console exporter wrote into the logs of one `tandem up` run (gateway, prefill and decode
workers), groups them by trace (one request), and reports for each span name the median and p90 of its start
(ms after the request's first span began) and of its duration, over the requests that have it, and the same
for each span event (offset from the request's start), so that a time-to-first-token can be read as a sequence
of phases: tokenize, route, decode admission (blocks reserved), the KV transfer (the prefill worker's queue and
forward inside it), the first token's way back. A table last.

`--burst N` adds a timeline of the last N requests (a burst sent at once, as `stack_overhead`'s): for each span
name the p10 / p50 / p90 / max of its start and of its end, in ms after the burst's first `generate`, and each
`prefill.batch` of the burst (when, how long, how many prompt tokens): when the prefill worker got busy, and
how far behind it the handoffs and the first decode steps ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of the console exporter in one log (each starts at a line `{` followed by `"name"`)."""
    spans, decoder = [], json.JSONDecoder()
    text = path.read_text(errors="replace")
    start = text.find('{\n    "name"')
    while start >= 0:
        try:
            span, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            end = start + 1
        else:
            if isinstance(span, dict) and "context" in span:
                spans.append(span)
        start = text.find('{\n    "name"', end)
    return spans


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        traces.setdefault(span["context"]["trace_id"], []).append(span)
    return traces


def first_trace(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans of the request that began first (a stack's first request: cold paths show there)."""
    traces = by_trace(spans)
    return min(traces.values(), key=lambda trace: min(_t(s["start_time"]) for s in trace)) if traces else []


def phases(spans: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    traces = by_trace(spans)
    rows: dict[str, dict[str, list[float]]] = {}
    for trace in traces.values():
        origin = min(_t(s["start_time"]) for s in trace)
        for span in trace:
            service = span.get("resource", {}).get("attributes", {}).get("service.name", "?")
            name = f"{service}:{span['name']}"
            start, end = _t(span["start_time"]), _t(span["end_time"])
            row = rows.setdefault(name, {"start": [], "duration": []})
            row["start"].append((start - origin) * 1e3)
            row["duration"].append((end - start) * 1e3)
            for event in span.get("events", []):
                event_row = rows.setdefault(f"{name} @{event['name']}", {"start": [], "duration": []})
                event_row["start"].append((_t(event["timestamp"]) - origin) * 1e3)
    out = {}
    for name, row in rows.items():
        starts, durations = sorted(row["start"]), sorted(row["duration"])
        out[name] = {"count": len(starts), "start_ms_p50": statistics.median(starts),
                     "start_ms_p90": starts[int(0.9 * (len(starts) - 1))]}
        if durations:
            out[name] |= {"duration_ms_p50": statistics.median(durations),
                          "duration_ms_p90": durations[int(0.9 * (len(durations) - 1))]}
    return dict(sorted(out.items(), key=lambda item: item[1]["start_ms_p50"]))


def _quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"p10": values[len(values) // 10], "p50": values[len(values) // 2],
            "p90": values[9 * len(values) // 10], "max": values[-1]}


def burst_timeline(spans: list[dict[str, Any]], num_requests: int) -> dict[str, Any]:
    """The last `num_requests` requests' spans on one clock (ms after the first of their `generate` spans)."""
    starts = sorted(_t(s["start_time"]) for s in spans if s["name"] == "generate")
    if not starts:
        return {}
    origin = starts[-min(num_requests, len(starts))]
    rows: dict[str, dict[str, list[float]]] = {}
    batches: list[dict[str, Any]] = []
    for span in spans:
        start, end = (_t(span["start_time"]) - origin) * 1e3, (_t(span["end_time"]) - origin) * 1e3
        if start < -1.0:  # before the burst (warm-up requests)
            continue
        row = rows.setdefault(span["name"], {"start": [], "end": []})
        row["start"].append(start)
        row["end"].append(end)
        for event in span.get("events", []):
            at = (_t(event["timestamp"]) - origin) * 1e3
            event_row = rows.setdefault(f"{span['name']} @{event['name']}", {"start": [], "end": []})
            event_row["start"].append(at)
            event_row["end"].append(at)
        if span["name"] == "prefill.batch":
            attributes = span.get("attributes", {})
            batches.append({"start_ms": start, "duration_ms": end - start,
                            "prompt_tokens": attributes.get("tandem.prompt_tokens", 0)})
    table: dict[str, dict[str, Any]] = {
        name: {"count": len(row["start"]), "start_ms": _quantiles(row["start"]), "end_ms": _quantiles(row["end"])}
        for name, row in rows.items()}
    return {"num_requests": num_requests,
            "spans": dict(sorted(table.items(), key=lambda item: item[1]["start_ms"]["p50"])),
            "prefill_batches": sorted(batches, key=lambda batch: batch["start_ms"])}


def print_timeline(timeline: dict[str, Any]) -> None:
    print(f"the last {timeline['num_requests']} requests, ms after the first one's generate "
          "(p10 / p50 / p90 / max)")
    print(f"{'span':24s} {'start':>31s}   {'end':>31s}")
    for name, row in timeline["spans"].items():
        start, end = ("/".join(f"{row[key][q]:7.1f}" for q in ("p10", "p50", "p90", "max"))
                      for key in ("start_ms", "end_ms"))
        print(f"{name[:24]:24s} {start}   {end}")
    batches = timeline["prefill_batches"]
    if batches:
        print(f"{len(batches)} prefill batches (start ms, duration ms, prompt tokens): " + ", ".join(
            f"{b['start_ms']:.0f}+{b['duration_ms']:.0f} ({b['prompt_tokens']})" for b in batches[:24])
            + (" ..." if len(batches) > 24 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", type=Path, help="a `tandem up` run's log folder")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--burst", type=int, default=0, metavar="N",
                        help="also the timeline of the last N requests (a burst), on one clock")
    args = parser.parse_args()
    spans = [span for log in sorted(args.logs.glob("*.log")) for span in read_spans(log)]
    table, first = phases(spans), phases(first_trace(spans))
    timeline = burst_timeline(spans, args.burst) if args.burst > 0 else {}
    if args.out is not None:
        args.out.write_text(json.dumps({"benchmark": "span_phases", "logs": str(args.logs), "num_spans": len(spans),
                                        "phases": table, "first_request": first, "burst": timeline}, indent=1))
    for title, rows in (("the stack's first request", first),
                        (f"{len(spans)} spans; ms from the request's first span (median / p90)", table)):
        print(title)
        print(f"{'span':60s} {'start':>15s} {'duration':>15s}")
        for name, row in rows.items():
            duration = (f"{row['duration_ms_p50']:7.2f}/{row['duration_ms_p90']:7.2f}" if "duration_ms_p50" in row
                        else "")
            print(f"{name[:60]:60s} {row['start_ms_p50']:7.2f}/{row['start_ms_p90']:7.2f} {duration:>15s}")
    if timeline:
        print_timeline(timeline)


if __name__ == "__main__":
    main()

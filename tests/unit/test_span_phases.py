"""`span_phases` reads what OpenTelemetry's console exporter wrote into a service log, and `--burst N` puts the last N
requests' spans on one clock: warm-up requests before the burst are left out, events become rows of their own, and
the prefill batches are listed in order."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from tandem.benchmarks.span_phases import burst_timeline, read_spans

MS = 1_000_000  # ns
T0 = 1_700_000_000_000 * MS


def write_log(path: Path) -> None:
    with path.open("w") as out:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=out)))
        tracer = provider.get_tracer("test")

        def span(name: str, start_ms: float, end_ms: float, attributes: dict | None = None,
                 events: tuple[tuple[str, float], ...] = ()) -> None:
            s = tracer.start_span(name, start_time=T0 + int(start_ms * MS), attributes=attributes)
            for event, at_ms in events:
                s.add_event(event, timestamp=T0 + int(at_ms * MS))
            s.end(end_time=T0 + int(end_ms * MS))

        span("generate", -500, -400)  # a warm-up request, long before the burst
        span("prefill.batch", -480, -470, {"tandem.prompt_tokens": 16})
        for i in range(10):  # the burst: request i arrives at 100 + i ms
            span("generate", 100 + i, 300 + 10 * i)
            span("decode.admission", 101 + i, 111 + i, events=(("queued", 111 + i),))
        span("prefill.batch", 130, 170, {"tandem.prompt_tokens": 8192})
        span("prefill.batch", 120, 125, {"tandem.prompt_tokens": 256})
        provider.shutdown()


def test_the_burst_on_one_clock(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    write_log(log)
    spans = read_spans(log)
    assert len(spans) == 2 + 20 + 2
    timeline = burst_timeline(spans, 10)
    rows = timeline["spans"]
    assert rows["generate"]["count"] == 10  # the warm-up one is before the origin
    ms = pytest.approx  # the exporter's timestamps are ISO strings of microseconds
    assert rows["generate"]["start_ms"]["p10"] == ms(1.0, abs=0.01)
    assert rows["generate"]["start_ms"]["max"] == ms(9.0, abs=0.01)
    assert rows["generate"]["end_ms"]["max"] == ms(290.0, abs=0.01)
    assert rows["decode.admission"]["end_ms"]["p50"] == ms(16.0, abs=0.01)
    assert rows["decode.admission @queued"]["count"] == 10
    assert rows["decode.admission @queued"]["start_ms"]["p50"] == ms(16.0, abs=0.01)
    batches = timeline["prefill_batches"]
    assert [(round(b["start_ms"]), round(b["duration_ms"]), b["prompt_tokens"]) for b in batches] == [
        (20, 5, 256), (30, 40, 8192)]

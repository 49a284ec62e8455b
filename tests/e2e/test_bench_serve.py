"""`tandem bench serve` against a small stack on dummy:tiny, its requests dealt to two load-generator processes: it
runs and reports (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.benchmarks.serve import LengthDist, workload
from tests.e2e.test_stack import start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_serve_reports_every_rate(tmp_path: Path, smollm2_path: Path) -> None:
    for stack in start_stack(tmp_path, model="dummy:tiny"):
        out, png = tmp_path / "serve.json", tmp_path / "serve.png"
        hits_before = stack.metric("decode", "tandem_prefix_cache_hits_total")  # the workers' warm-up's own
        done = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "bench", "serve", "--address", stack.address("gateway"),
             "--rates", "4,inf", "--num-requests", "6", "--prompt-len", "uniform:8:40",
             "--output-len", "fixed:5", "--client-processes", "2", "--out", str(out), "--plot", str(png)],
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        report = json.loads(out.read_text())
        assert [r["rate"] for r in report["results"]] == [4.0, "inf"]
        for result in report["results"]:
            assert result["num_ok"] == 6 and not result["errors"]
            # Dealt to two load-generator processes, the records come back in the order of the workload's requests.
            assert result["client_processes"] == 2 and result["client_cpu_s"] > 0
            expected = [len(prompt) for prompt, _ in workload(6, LengthDist.parse("uniform:8:40"),
                                                               LengthDist.parse("fixed:5"), result["seed"])]
            assert [r["prompt_len"] for r in result["records"]] == expected
            assert result["output_tok_per_s"] > 0 and result["ttft_s"]["p99"] is not None
            assert all(r["num_tokens"] == 5 for r in result["records"])
            assert 0.0 <= result["slo_attainment"] <= 1.0
        assert png.stat().st_size > 0
        assert "goodput" in done.stdout  # the table is printed last
        # Every rate sent prompts of its own: none came out of the prefix cache (a rate that repeated an earlier
        # one's would have measured decode alone).
        assert report["results"][0]["seed"] != report["results"][1]["seed"]
        assert stack.metric("decode", "tandem_prefix_cache_hits_total") == hits_before

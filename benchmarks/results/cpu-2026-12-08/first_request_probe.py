"""The stack's first request against steady, then again from fresh clients (2026-12-08, #14 item 4). Run with
`TANDEM_HOME=... OTEL_TRACES_EXPORTER=console OTEL_BSP_SCHEDULE_DELAY=200 python first_request_probe.py`, then
`python -m tandem.benchmarks.span_phases $TANDEM_HOME/logs/<run> --out first-request-phases.json`."""
import sys
from pathlib import Path

from tandem.benchmarks.serve_modes import first_request_ttft, running_stack

sys.argv = ["probe"]
with running_stack("colocated", "dummy:tiny", "cpu", 64, [], Path("/tmp/cold.json"), 1) as (address, _, _):
    for i in range(3):
        print("new client", i, first_request_ttft(address, 64, repeats=5))

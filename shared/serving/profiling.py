"""An engine thread's steps under `torch.profiler`, switched on from the environment of a served worker.

`TANDEM_PROFILE_STEPS="prefill:1-40,decode:1-400@2"` profiles those steps (1-based, inclusive) of each worker of
that role, counted from the start of its busy period `@N` (default 1): a busy period starts with the first step
after the engine had nothing to run for `IDLE_GAP_S`, so `@2` skips a warm-up burst whatever its length.
`TANDEM_PROFILE_DIR` (default `$TANDEM_HOME/profiles`) gets, per worker process, `<role>-<pid>.trace.json.gz` (a
Chrome trace: open it in Perfetto or `chrome://tracing`), `<role>-<pid>.ops.txt` (the operators by self time) and
`<role>-<pid>.steps.json` (each profiled step's wall time, tokens and batch). They are written when the range
ends, when its busy period ends first, or when the worker stops. One profiler session covers the whole range, so
the gaps between kernels and between steps are in the trace: that is what it is for (a step whose GPU time is far
below its wall time waited on the host). `python -m tandem.benchmarks.profile_steps DIR` summarizes them."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tandem.common.config import ConfigError
from tandem.common.paths import tandem_home

log = logging.getLogger(__name__)

PROFILE_STEPS_ENV = "TANDEM_PROFILE_STEPS"
PROFILE_DIR_ENV = "TANDEM_PROFILE_DIR"
# Idle this long between steps ends a busy period (a burst's requests arrive over ~100 ms; bursts seconds apart).
IDLE_GAP_S = 1.0

_RANGE = re.compile(r"^\s*([a-z_]+)\s*:\s*(\d+)\s*-\s*(\d+)\s*(?:@\s*(\d+)\s*)?$")


class StepRange(NamedTuple):
    first: int
    last: int
    period: int = 1


def parse_step_ranges(value: str) -> dict[str, StepRange]:
    """`"prefill:1-40,decode:1-400@2"` → {"prefill": (1, 40, 1), "decode": (1, 400, 2)}; anything else is a
    ConfigError naming the variable and the part it could not read."""
    ranges: dict[str, StepRange] = {}
    for part in value.split(","):
        if not part.strip():
            continue
        match = _RANGE.match(part)
        if match is None:
            raise ConfigError(f"{PROFILE_STEPS_ENV}: {part.strip()!r} is not ROLE:FIRST-LAST[@BUSY_PERIOD] "
                              "(e.g. decode:1-400@2)")
        role, first, last = match.group(1), int(match.group(2)), int(match.group(3))
        period = int(match.group(4) or 1)
        if first < 1 or last < first or period < 1:
            raise ConfigError(f"{PROFILE_STEPS_ENV}: {part.strip()!r} needs 1 <= FIRST <= LAST and BUSY_PERIOD >= 1")
        if role in ranges:
            raise ConfigError(f"{PROFILE_STEPS_ENV}: role {role!r} is given twice")
        ranges[role] = StepRange(first, last, period)
    return ranges


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


@dataclass
class StepProfiler:
    """Profiles steps `first`..`last` of busy period `period` of one engine thread. The engine thread calls
    `before_step` / `after_step` around each step and `idle()` while it has nothing to run; `close()` at its end."""

    role: str
    first: int
    last: int
    out_dir: Path
    period: int = 1
    idle_gap_s: float = IDLE_GAP_S
    num_periods: int = 0
    num_steps: int = 0  # in the current busy period
    steps: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    _profile: Any = None
    _step_range: Any = None
    _start: float = 0.0
    _last_end: float = float("-inf")

    @classmethod
    def from_env(cls, role: str) -> StepProfiler | None:
        """The profiler the environment asks for this role, or None."""
        ranges = parse_step_ranges(os.environ.get(PROFILE_STEPS_ENV, ""))
        if role not in ranges:
            return None
        out_dir = Path(os.environ.get(PROFILE_DIR_ENV) or tandem_home() / "profiles")
        # Kineto initialises on first use and wants the thread that imported torch (the main one, which calls this):
        # a first session started on the engine thread logs "External init callback must run in same thread".
        with torch.profiler.profile(activities=_activities()):
            pass
        first, last, period = ranges[role]
        return cls(role, first, last, out_dir, period)

    @property
    def stem(self) -> Path:
        return self.out_dir / f"{self.role}-{os.getpid()}"

    def before_step(self) -> None:
        if self.done:
            return
        now = time.perf_counter()
        if now - self._last_end > self.idle_gap_s:
            self.num_periods += 1
            self.num_steps = 0
            log.info("%s engine: busy period %d begins (profiling steps %d-%d of period %d)", self.role,
                     self.num_periods, self.first, self.last, self.period)
        self.num_steps += 1
        if self.num_periods != self.period:
            return
        if self.num_steps == self.first:
            self._profile = torch.profiler.profile(activities=_activities())
            self._profile.start()
        if self._profile is not None:
            self._step_range = torch.profiler.record_function(f"{self.role} step {self.num_steps}")
            self._step_range.__enter__()
            self._start = time.perf_counter()

    def after_step(self, seconds: float, num_tokens: int, batch_size: int) -> None:
        """`seconds`: the step's wall time as the caller measured it; `num_tokens`: tokens it computed."""
        self._last_end = time.perf_counter()
        if self._profile is None:
            return
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        self.steps.append({"step": self.num_steps, "wall_ms": round(seconds * 1e3, 3), "num_tokens": num_tokens,
                           "batch_size": batch_size, "at_s": round(self._start, 6)})
        if self.num_steps >= self.last:
            self.close()

    def idle(self) -> None:
        """The engine has nothing to run: a range whose busy period ended is written now, not at the next step."""
        if self._profile is not None and time.perf_counter() - self._last_end > self.idle_gap_s:
            self.close()

    def close(self) -> None:
        """Stop the session (if one runs) and write its files."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        if self._step_range is not None:  # stopped inside a step
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        profile.stop()
        self.done = True
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.stem
        profile.export_chrome_trace(f"{stem}.trace.json.gz")
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        Path(f"{stem}.ops.txt").write_text(profile.key_averages().table(sort_by=sort_by, row_limit=60) + "\n")
        Path(f"{stem}.steps.json").write_text(json.dumps(
            {"role": self.role, "pid": os.getpid(), "first": self.first, "last": self.last, "period": self.period,
             "steps": self.steps}, indent=1) + "\n")
        log.info("%s engine: %d profiled steps written to %s.*", self.role, len(self.steps), stem)

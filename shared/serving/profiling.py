"""An engine thread's steps under `torch.profiler`, switched on from the environment of a served worker.

`TANDEM_PROFILE_STEPS="prefill:1-40,decode:100-400"` profiles those steps (1-based, inclusive) of each worker of
that role; `TANDEM_PROFILE_DIR` (default `$TANDEM_HOME/profiles`) gets, per worker process,
`<role>-<pid>.trace.json.gz` (a Chrome trace: open it in Perfetto or `chrome://tracing`), `<role>-<pid>.ops.txt`
(the operators by self time) and `<role>-<pid>.steps.json` (each profiled step's wall time, tokens and batch).
One profiler session covers the whole range, so the gaps between kernels, and between steps, are in the trace:
that is what it is for (a step whose GPU time is far below its wall time waited on the host)."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.common.config import ConfigError
from tandem.common.paths import tandem_home

PROFILE_STEPS_ENV = "TANDEM_PROFILE_STEPS"
PROFILE_DIR_ENV = "TANDEM_PROFILE_DIR"

_RANGE = re.compile(r"^\s*([a-z_]+)\s*:\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_step_ranges(value: str) -> dict[str, tuple[int, int]]:
    """`"prefill:1-40,decode:1-400"` → {"prefill": (1, 40), "decode": (1, 400)}; anything else is a ConfigError
    naming the variable and the part it could not read."""
    ranges: dict[str, tuple[int, int]] = {}
    for part in value.split(","):
        if not part.strip():
            continue
        match = _RANGE.match(part)
        if match is None:
            raise ConfigError(f"{PROFILE_STEPS_ENV}: {part.strip()!r} is not ROLE:FIRST-LAST (e.g. decode:1-400)")
        role, first, last = match.group(1), int(match.group(2)), int(match.group(3))
        if first < 1 or last < first:
            raise ConfigError(f"{PROFILE_STEPS_ENV}: {part.strip()!r} needs 1 <= FIRST <= LAST")
        if role in ranges:
            raise ConfigError(f"{PROFILE_STEPS_ENV}: role {role!r} is given twice")
        ranges[role] = (first, last)
    return ranges


@dataclass
class StepProfiler:
    """Profiles steps `first`..`last` of one engine thread; `before_step` / `after_step` bracket each step.
    Writes its files when the range ends or on `close()` (a worker stopped mid-range keeps what it saw)."""

    role: str
    first: int
    last: int
    out_dir: Path
    num_steps: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)
    _profile: Any = None
    _step_range: Any = None
    _start: float = 0.0
    done: bool = False

    @classmethod
    def from_env(cls, role: str) -> StepProfiler | None:
        """The profiler the environment asks for this role, or None."""
        ranges = parse_step_ranges(os.environ.get(PROFILE_STEPS_ENV, ""))
        if role not in ranges:
            return None
        out_dir = Path(os.environ.get(PROFILE_DIR_ENV) or tandem_home() / "profiles")
        first, last = ranges[role]
        return cls(role, first, last, out_dir)

    @property
    def stem(self) -> Path:
        return self.out_dir / f"{self.role}-{os.getpid()}"

    def before_step(self) -> None:
        if self.done:
            return
        self.num_steps += 1
        if self.num_steps == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.start()
        if self._profile is not None:
            self._step_range = torch.profiler.record_function(f"{self.role} step {self.num_steps}")
            self._step_range.__enter__()
            self._start = time.perf_counter()

    def after_step(self, seconds: float, num_tokens: int, batch_size: int) -> None:
        """`seconds`: the step's wall time as the caller measured it; `num_tokens`: tokens it computed."""
        if self._profile is None:
            return
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        self.steps.append({"step": self.num_steps, "wall_ms": round(seconds * 1e3, 3), "num_tokens": num_tokens,
                           "batch_size": batch_size, "at": round(self._start, 6)})
        if self.num_steps >= self.last:
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
            {"role": self.role, "pid": os.getpid(), "first": self.first, "last": self.last, "steps": self.steps},
            indent=1) + "\n")

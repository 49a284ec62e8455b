"""Sharing one GPU between prefill and decode workers through CUDA MPS (`tandem up --gpu-split P[:D]`).

tandem starts its own MPS control daemon with its own pipe and log directories (so it never touches another
user's daemon) and stops it afterwards; it never changes the GPU's compute mode. Each worker process joins it
through `CUDA_MPS_PIPE_DIRECTORY` and is limited to a share of the SMs by `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`:
P% for prefill workers and D% (by default 100 - P) for decode workers. The shares are caps, not reservations:
`100:100` lets both run kernels side by side on every SM (MPS without partitioning), where plain time-sharing
gives the GPU to one process at a time. A role may also run at MPS's lower client priority
(`CUDA_MPS_CLIENT_PRIORITY=1`), so the other's kernels are scheduled first when both have work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class GpuSplit:
    """Each role's SM cap in percent, and which role (if any) runs at the lower MPS client priority."""

    prefill_percentage: int
    decode_percentage: int
    low_priority_role: str | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_percentage", "decode_percentage"):
            value = getattr(self, name)
            if not 1 <= value <= 100:
                raise ValueError(f"gpu_split: {name} must be in [1, 100], got {value}")
        if self.low_priority_role not in (None, *ROLES):
            raise ValueError(f"gpu_split: low_priority_role must be prefill or decode, got {self.low_priority_role!r}")

    @classmethod
    def parse(cls, text: str, low_priority_role: str | None = None) -> GpuSplit:
        """`P` (prefill P%, decode the rest; 1 <= P <= 99) or `P:D` (each 1..100)."""
        parts = text.split(":")
        try:
            values = [int(part) for part in parts]
        except ValueError:
            raise ValueError(f"gpu_split: expected P or P:D (percentages), got {text!r}") from None
        if len(values) == 1:
            if not 1 <= values[0] <= 99:
                raise ValueError(f"gpu_split: P must be in [1, 99] (decode gets 100 - P), got {text!r}")
            return cls(values[0], 100 - values[0], low_priority_role)
        if len(values) == 2:
            return cls(values[0], values[1], low_priority_role)
        raise ValueError(f"gpu_split: expected P or P:D (percentages), got {text!r}")

    def percentage(self, role: str) -> int:
        return self.prefill_percentage if role == "prefill" else self.decode_percentage


@dataclass
class MpsDaemon:
    """An MPS control daemon of tandem's own. `start()` then `env_for(role)` per worker, `stop()` at the end."""

    split: GpuSplit
    directory: Path | None = None

    @property
    def _env(self) -> dict[str, str]:
        assert self.directory is not None, "start() first"
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.directory / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "log")}

    def start(self) -> None:
        if shutil.which(CONTROL) is None:
            raise RuntimeError(f"--gpu-split needs CUDA MPS: {CONTROL} is not on the PATH")
        self.directory = Path(tempfile.mkdtemp(prefix="tandem-mps-"))
        for name in ("pipe", "log"):
            (self.directory / name).mkdir()
        subprocess.run([CONTROL, "-d"], env=dict(os.environ, **self._env), check=True, timeout=30)

    def env_for(self, role: str) -> dict[str, str]:
        """What a worker of `role` needs in its environment (nothing for the gateway: it has no GPU work)."""
        if role not in ROLES:
            return {}
        env = {**self._env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(self.split.percentage(role))}
        if role == self.split.low_priority_role:
            env["CUDA_MPS_CLIENT_PRIORITY"] = "1"  # below normal
        return env

    def stop(self) -> None:
        if self.directory is None:
            return
        subprocess.run([CONTROL], input=b"quit\n", env=dict(os.environ, **self._env), timeout=30, check=False)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

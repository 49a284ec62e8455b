"""SM partitioning of one GPU between prefill and decode workers through CUDA MPS (`tandem up --gpu-split P`).

tandem starts its own MPS control daemon with its own pipe and log directories (so it never touches another
user's daemon) and stops it afterwards; it never changes the GPU's compute mode. Each worker process joins it
through `CUDA_MPS_PIPE_DIRECTORY` and is limited to a share of the SMs by `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`:
P% for prefill workers, (100 - P)% for decode workers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


@dataclass
class MpsDaemon:
    """An MPS control daemon of tandem's own. `start()` then `env_for(role)` per worker, `stop()` at the end."""

    prefill_percentage: int
    directory: Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.prefill_percentage < 100:
            raise ValueError(f"gpu_split must be in (0, 100), got {self.prefill_percentage}")

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
        if role not in ("prefill", "decode"):
            return {}
        share = self.prefill_percentage if role == "prefill" else 100 - self.prefill_percentage
        return {**self._env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)}

    def stop(self) -> None:
        if self.directory is None:
            return
        subprocess.run([CONTROL], input=b"quit\n", env=dict(os.environ, **self._env), timeout=30, check=False)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

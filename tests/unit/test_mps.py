"""`tandem up --gpu-split P[:D]`: tandem's own MPS control daemon (its own pipe directory, started and stopped by
tandem), and each worker's SM share in its environment. The control binary is faked: it records how it was
called, as the real one would be."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tandem.launcher import Stack, StackOptions
from tandem.mps import GpuSplit, MpsDaemon


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    calls = tmp_path / "calls.log"
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\necho "$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat -)" >> {calls}\n')
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_daemon_of_its_own_and_a_share_per_role(fake_control: Path) -> None:
    daemon = MpsDaemon(GpuSplit.parse("60"))
    daemon.start()
    pipe = daemon.env_for("prefill")["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith(str(daemon.directory)) and Path(pipe).is_dir()
    assert daemon.env_for("prefill")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
    assert daemon.env_for("decode")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert daemon.env_for("gateway") == {}
    daemon.stop()
    lines = fake_control.read_text().splitlines()
    assert lines[0].startswith(f"-d pipe={pipe}") and lines[1] == f" pipe={pipe} stdin=quit"
    assert not Path(pipe).exists()


def test_split_out_of_range_is_refused() -> None:
    for bad in ("0", "100", "0:50", "50:101", "60:40:10", "sixty", ""):
        with pytest.raises(ValueError, match="gpu_split"):
            GpuSplit.parse(bad)
    with pytest.raises(ValueError, match="low_priority_role"):
        GpuSplit.parse("60", "gateway")


def test_caps_per_role_and_the_lower_priority(fake_control: Path) -> None:
    """`P:D` caps each role on its own (100:100 is MPS with no partition); the low-priority role gets MPS's
    below-normal client priority, the other none."""
    daemon = MpsDaemon(GpuSplit.parse("100:100", "decode"))
    daemon.start()
    prefill, decode = daemon.env_for("prefill"), daemon.env_for("decode")
    assert prefill["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == decode["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert decode["CUDA_MPS_CLIENT_PRIORITY"] == "1" and "CUDA_MPS_CLIENT_PRIORITY" not in prefill
    daemon.stop()


def test_missing_mps_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="nvidia-cuda-mps-control"):
        MpsDaemon(GpuSplit.parse("50")).start()


def test_launcher_gives_each_worker_its_share(fake_control: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    envs: dict[str, dict[str, str]] = {}

    class Recorder:
        def __init__(self, command: list[str], env: dict[str, str], **_: object) -> None:
            envs[command[3]] = env  # python -m tandem.cli ROLE ...

    stack = Stack(StackOptions(model="dummy:tiny", log_dir=tmp_path, gpu_split=GpuSplit.parse("70")))
    stack._plan()
    assert stack.mps is not None
    stack.mps.start()
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", Recorder)  # the services' processes, recorded rather than started
    for service in stack.services:
        stack._spawn(service)
    monkeypatch.setattr(subprocess, "Popen", popen)
    assert envs["prefill"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    assert envs["decode"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in envs["gateway"]
    stack.mps.stop()


def test_one_gpu_disaggregation_defaults_to_mps_without_caps(fake_control: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with prefill and decode workers, `tandem up` shares it through MPS with neither capped (measured
    better than time-sharing); time-sharing where MPS is missing, where asked (`auto_mps=False`: --gpu-split off),
    colocated (no prefill worker) and on the CPU."""
    def split(**kwargs: object) -> GpuSplit | None:
        stack = Stack(StackOptions(model="dummy:tiny", log_dir=tmp_path, **kwargs))  # type: ignore[arg-type]
        return stack.mps.split if stack.mps is not None else None

    assert split(device="cuda") == GpuSplit(100, 100)
    assert split(device="cuda", auto_mps=False) is None
    assert split(device="cuda", num_prefill=0) is None
    assert split(device="cpu") is None
    assert split(device="cuda", gpu_split=GpuSplit.parse("60")) == GpuSplit(60, 40)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert split(device="cuda") is None

"""Engine choices reach every surface: `EngineConfig` resolves async scheduling for the device, `tandem up` passes
`--async-scheduling/--no-async-scheduling` to its workers, and a bad `--gpu-split` is refused naming the flag."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tandem.cli import app
from tandem.common.config import EngineConfig
from tandem.launcher import Stack, StackOptions
from tandem.models import load_model_config


def test_async_scheduling_is_on_for_cuda_and_off_on_the_cpu_unless_chosen() -> None:
    model = load_model_config("dummy:tiny", fetch=False)
    assert EngineConfig.create(model, device="cuda").async_scheduling is True
    assert EngineConfig.create(model, device="cpu").async_scheduling is False
    assert EngineConfig.create(model, device="cuda", async_scheduling=False).async_scheduling is False
    assert EngineConfig.create(model, device="cpu", async_scheduling=True).async_scheduling is True


def test_tandem_up_passes_the_choice_to_its_workers(tmp_path: Path) -> None:
    for choice, flag in ((True, "--async-scheduling"), (False, "--no-async-scheduling"), (None, None)):
        stack = Stack(StackOptions(model="dummy:tiny", log_dir=tmp_path, async_scheduling=choice))
        stack._plan()
        for service in stack.services:
            flags = {f for f in service.command if "async-scheduling" in f}
            expected = {flag} if flag and service.role != "gateway" else set()
            assert flags == expected, (service.role, choice)


def test_a_bad_gpu_split_is_refused_naming_the_flag() -> None:
    runner = CliRunner()
    for args, named in ((["--gpu-split", "150"], "--gpu-split"), (["--gpu-split", "half"], "--gpu-split"),
                        (["--gpu-split-low-priority", "decode"], "--gpu-split-low-priority")):
        result = runner.invoke(app, ["up", "--model", "dummy:tiny", *args])
        assert result.exit_code == 2, result.output
        assert named in result.output

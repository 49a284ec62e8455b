"""Engine choices reach every surface: `EngineConfig` resolves async scheduling for the device, `tandem up` passes
`--async-scheduling/--no-async-scheduling` to its workers, and a bad `--gpu-split` is refused naming the flag; workers
sharing one GPU get memory shares by role."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest import MonkeyPatch
from typer.testing import CliRunner

from tandem import launcher
from tandem.cli import app
from tandem.common.config import SHARED_GPU_PREFILL_BATCHED_TOKENS, EngineConfig
from tandem.launcher import Stack, StackOptions
from tandem.models import load_model_config
from tandem.mps import GpuSplit


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


def test_gpu_memory_shares_give_prefill_workers_what_they_need_and_decode_the_rest() -> None:
    model = load_model_config("dummy:llama-3.1-8b", fetch=False)
    total = 143_771 << 20  # an H200
    kv_per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * 2
    weights = launcher.weight_bytes_estimate(model, None)
    assert 15.5e9 < weights < 16.5e9  # Llama-3.1-8B's ~8.0B parameters in bf16
    assert launcher.weight_bytes_estimate(model, "int8") < 0.6 * weights
    need = weights + launcher.PREFILL_POOL_STEPS * 8192 * kv_per_token + launcher.PREFILL_WORKSPACE_BYTES
    for num_prefill in (1, 2):
        prefill, decode = launcher.gpu_memory_shares(model, total, num_prefill, 1, 8192, kv_per_token)
        assert abs(prefill - need / total) < 1e-3
        assert abs(num_prefill * prefill + decode - launcher.GPU_MEMORY_FRACTION_SHARED) < 2e-3
        assert decode > prefill
    # Two decode workers split the rest; so many prefill workers that each would need more than an even share, no
    # prefill worker, or an unknown GPU: an even split.
    prefill, decode = launcher.gpu_memory_shares(model, total, 1, 2, 8192, kv_per_token)
    assert abs(prefill + 2 * decode - launcher.GPU_MEMORY_FRACTION_SHARED) < 2e-3
    for num_prefill, num_decode, gpu in ((6, 1, total), (0, 1, total), (1, 1, 0)):
        even = round(launcher.GPU_MEMORY_FRACTION_SHARED / (num_prefill + num_decode), 3)
        assert launcher.gpu_memory_shares(model, gpu, num_prefill, num_decode, 8192, kv_per_token) == (even, even)


def test_weight_estimate_matches_the_model_built() -> None:
    import dataclasses

    import torch

    from tandem.engine.model import LlamaForCausalLM
    from tandem.kernels import get_ops

    tiny = load_model_config("dummy:tiny", fetch=False)
    big = load_model_config("dummy:llama-3.1-8b", fetch=False)
    for model_config in (tiny, dataclasses.replace(tiny, tie_word_embeddings=False), big):
        with torch.device("meta"):  # shapes only
            model = LlamaForCausalLM(model_config, get_ops("torch"))
        params = {id(p): p for p in model.parameters()}.values()  # tied embeddings once
        numel = sum(p.numel() for p in params if p.dim() == 2)  # the norms left out, as the estimate does
        assert launcher.weight_bytes_estimate(model_config, None) == 2 * numel, model_config.name


def test_tandem_up_on_one_gpu_gives_each_role_its_memory_share(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "gpu_total_bytes", lambda: 143_771 << 20)
    # Each worker its own weights (shared weights: the test below).
    stack = Stack(StackOptions(model="dummy:llama-3.1-8b", device="cuda", num_prefill=2, log_dir=tmp_path,
                               gpu_split=GpuSplit(70, 100), share_weights=False))
    stack._plan()
    shares: dict[str, set[float]] = {}
    for service in stack.services:
        if service.role != "gateway":
            command = service.command
            shares.setdefault(service.role, set()).add(float(command[command.index("--gpu-memory-fraction") + 1]))
    (prefill,), (decode,) = shares["prefill"], shares["decode"]
    assert 0.15 < prefill < 0.25 and abs(2 * prefill + decode - 0.85) < 2e-3
    # A fraction given on the command line is every worker's.
    stack = Stack(StackOptions(model="dummy:llama-3.1-8b", device="cuda", num_prefill=2, log_dir=tmp_path,
                               gpu_split=GpuSplit(70, 100), gpu_memory_fraction=0.3))
    stack._plan()
    assert all(s.command[s.command.index("--gpu-memory-fraction") + 1] == "0.3"
               for s in stack.services if s.role != "gateway")


def test_tandem_up_on_one_gpu_gives_prefill_the_served_step_budget(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    # A prefill worker beside decode on one GPU: its steps take SMs from decode's while they run, so it takes
    # decode's 2,048-token budget rather than a lone prefill GPU's 8,192; a budget given on the command line is
    # everyone's.
    monkeypatch.setattr(launcher, "gpu_total_bytes", lambda: 143_771 << 20)

    def budgets(**options: Any) -> dict[str, list[str]]:
        stack = Stack(StackOptions(model="dummy:llama-3.1-8b", log_dir=tmp_path, **options))
        stack._plan()
        return {s.role: [s.command[i + 1] for i, flag in enumerate(s.command) if flag == "--max-num-batched-tokens"]
                for s in stack.services if s.role != "gateway"}

    assert budgets(device="cuda") == {"prefill": [str(SHARED_GPU_PREFILL_BATCHED_TOKENS)], "decode": []}
    assert SHARED_GPU_PREFILL_BATCHED_TOKENS == 2048
    assert budgets(device="cuda", max_num_batched_tokens=4096) == {"prefill": ["4096"], "decode": ["4096"]}
    assert budgets(device="cpu") == {"prefill": [], "decode": []}  # the CPU's own default (256) for both


def test_prefill_workers_sharing_weights_map_the_first_decode_workers_and_need_no_room_for_them(
        tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "gpu_total_bytes", lambda: 80 << 30)  # an H100
    model = load_model_config("dummy:llama-3.1-8b", fetch=False)
    kv_per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * 2
    own = launcher.gpu_memory_shares(model, 80 << 30, 2, 1, 2048, kv_per_token)
    mapped = launcher.gpu_memory_shares(model, 80 << 30, 2, 1, 2048, kv_per_token, shared_weights=True)
    weights = launcher.weight_bytes_estimate(model, None)
    rest = launcher.PREFILL_POOL_STEPS * 2048 * kv_per_token + launcher.PREFILL_WORKSPACE_BYTES
    even = launcher.GPU_MEMORY_FRACTION_SHARED / 3
    assert abs(own[0] - min(even, (weights + rest) / (80 << 30))) < 2e-3  # on 80 GB: capped at an even share
    assert abs(mapped[0] - rest / (80 << 30)) < 2e-3  # its pool and workspace, no weights
    assert abs(mapped[1] - (launcher.GPU_MEMORY_FRACTION_SHARED - 2 * mapped[0])) < 2e-3
    assert mapped[1] > own[1] + 0.3  # decode gets what the two copies took (~24 GB more on this card)

    def weights_from(**options: Any) -> dict[str, list[str]]:
        options.setdefault("num_decode", 2)
        stack = Stack(StackOptions(model="dummy:llama-3.1-8b", log_dir=tmp_path, num_prefill=2, **options))
        stack._plan()
        decode = [s.grpc for s in stack.services if s.role == "decode"]
        found: dict[str, list[str]] = {"prefill": [], "decode": []}
        for service in stack.services:
            if service.role != "gateway":
                found[service.role] += [service.command[i + 1] for i, flag in enumerate(service.command)
                                        if flag == "--weights-from"]
        assert all(address == decode[0] for addresses in found.values() for address in addresses)
        return found

    # The default on a GPU with one decode worker; asked for, with several too.
    for options in ({"device": "cuda", "num_decode": 1}, {"device": "cuda", "share_weights": True}):
        shared = weights_from(**options)
        assert len(shared["prefill"]) == 2 and shared["decode"] == []  # each prefill worker, the first decode worker's
    # Not when turned off, not on the CPU, not with a fraction given for every worker (it assumes each its own weights);
    # not by default with several decode workers (one crash would stop every prefill worker) or expandable segments.
    for options in ({"device": "cuda", "share_weights": False, "num_decode": 1}, {"device": "cpu", "num_decode": 1},
                    {"device": "cuda", "gpu_memory_fraction": 0.3, "share_weights": True}, {"device": "cuda"}):
        assert weights_from(**options) == {"prefill": [], "decode": []}, options
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    assert weights_from(device="cuda", num_decode=1) == {"prefill": [], "decode": []}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    # `tandem up --share-weights / --no-share-weights` reach the options; neither leaves it to the stack (None).
    monkeypatch.setattr(Stack, "run", lambda self, **kw: print(self.options.share_weights) or 0)
    for flags, expected in ((["--share-weights"], "True"), (["--no-share-weights"], "False"), ([], "None")):
        assert CliRunner().invoke(app, ["up", "--model", "dummy:tiny", *flags]).output.strip() == expected


def test_with_shared_weights_tandem_up_stops_decode_workers_only_after_the_rest(
        tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    import subprocess
    import sys
    import time

    monkeypatch.setattr(launcher, "gpu_total_bytes", lambda: 80 << 30)
    # Each stand-in service notes when SIGTERM reached it, takes 0.3 s to drain, notes its exit.
    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    open(sys.argv[1], 'a').write(f'term {time.monotonic()}\\n'); time.sleep(0.3)\n"
              "    open(sys.argv[1], 'a').write(f'exit {time.monotonic()}\\n'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "open(sys.argv[1], 'a').write('up\\n')\n"
              "time.sleep(60)\n")
    for share in (True, False):
        stack = Stack(StackOptions(model="dummy:llama-3.1-8b", device="cuda", num_prefill=2, log_dir=tmp_path,
                                   share_weights=share, gpu_split=GpuSplit(100, 100)))
        stack._plan()
        stack.mps = None
        notes = {}
        for i, service in enumerate(stack.services):
            notes[i] = tmp_path / f"{share}-{service.role}-{i}.txt"
            service.process = subprocess.Popen([sys.executable, "-c", script, str(notes[i])])
        for path in notes.values():
            while not path.exists():
                time.sleep(0.01)
        stack.stop()
        times = {i: dict(line.split() for line in path.read_text().splitlines() if " " in line)
                 for i, path in notes.items()}
        roles = {i: s.role for i, s in enumerate(stack.services)}
        last_other_exit = max(float(t["exit"]) for i, t in times.items() if roles[i] != "decode")
        first_decode_term = min(float(t["term"]) for i, t in times.items() if roles[i] == "decode")
        assert (first_decode_term >= last_other_exit) == share, share

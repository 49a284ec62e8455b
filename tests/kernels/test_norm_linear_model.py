"""The norm_linear and silu_linear fusions in the model (`LlamaDecoderLayer.norm_linear`, `LlamaMLP.down`): with
them on, a quantized layer's qkv and gate_up projections of one token run the RMSNorm inside their launch and its
down projection the SwiGLU activation, and the logits are those of the unfused path; steps of more than one token
keep the separate kernels. Triton's interpreter on the CPU (fp32), or a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import tandem.engine.quantization as quantization_module
from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.kernels import get_ops
from tandem.models import load_model_config


def _runner(quantization: str, fusions: str, device: torch.device) -> ModelRunner:
    model = replace(load_model_config("dummy:tiny", fetch=False), quantization=quantization)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=8, num_blocks=16),
                          scheduler=SchedulerConfig(max_model_len=64), device=device.type, use_cuda_graphs=False)
    return ModelRunner(config, ops=get_ops("triton", fusions))


def _prefill_then_decode(r: ModelRunner, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the prompt's last token, logits of one decode step after it)."""
    request = Request(req_id="q", prompt_token_ids=prompt, params=SamplingParams(max_tokens=2), seed=0)
    request.block_ids = [3, 9, 1, 6]
    prefill = r.chunk_logits([(request, 0, len(prompt))], [1])
    request.output_token_ids.append(int(prefill.argmax()))
    request.num_computed_tokens = len(prompt)
    return prefill, r.decode_logits([request])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_norm_linear_fusion_gives_the_unfused_logits(quantization: str, device: torch.device,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if quantization == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need compute capability 8.9")
    calls: list[tuple[int, bool]] = []
    real = quantization_module.small_m_add_norm_linear_triton

    def spy(x: torch.Tensor, residual: torch.Tensor | None, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((x.shape[0], residual is not None))
        return real(x, residual, *args, **kwargs)

    monkeypatch.setattr(quantization_module, "small_m_add_norm_linear_triton", spy)
    prompt = list(range(300, 319))
    torch.manual_seed(0)
    unfused = _runner(quantization, "all", device)
    torch.manual_seed(0)
    fused = _runner(quantization, "all+norm_linear", device)
    with torch.inference_mode():
        expected = _prefill_then_decode(unfused, prompt)
        assert calls == []  # the fusion off: never
        got = _prefill_then_decode(fused, prompt)
    num_layers = fused.model.num_layers
    # Only the decode step's one token: qkv and gate_up of every layer; the first layer's qkv has no residual yet.
    assert calls == [(1, not (layer == 0 and proj == "qkv")) for layer in range(num_layers)
                     for proj in ("qkv", "gate_up")]
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)  # the prompt's step is unchanged
    scale = expected[1].abs().max()
    # fp32 on the CPU: only the order of the mean square's sum differs; bf16 on a GPU may round a value differently.
    tolerance = 1e-5 if expected[1].dtype == torch.float32 else 2e-2
    assert (got[1] - expected[1]).abs().max() <= tolerance * scale


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_silu_linear_fusion_gives_the_unfused_logits(quantization: str, device: torch.device,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if quantization == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need compute capability 8.9")
    calls: list[int] = []
    real = quantization_module.small_m_silu_linear_triton

    def spy(gate_up: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(gate_up.shape[0])
        return real(gate_up, *args, **kwargs)

    monkeypatch.setattr(quantization_module, "small_m_silu_linear_triton", spy)
    prompt = list(range(300, 319))
    torch.manual_seed(0)
    unfused = _runner(quantization, "all", device)
    torch.manual_seed(0)
    fused = _runner(quantization, "all+silu_linear", device)
    with torch.inference_mode():
        expected = _prefill_then_decode(unfused, prompt)
        got = _prefill_then_decode(fused, prompt)
    assert calls == [1] * fused.model.num_layers  # the decode step's down projections only
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    # the same arithmetic in the same order: equal on the CPU; bf16 on a GPU may differ in the last place
    tolerance = 0.0 if expected[1].dtype == torch.float32 else 2e-2
    assert (got[1] - expected[1]).abs().max() <= tolerance * expected[1].abs().max()


@pytest.mark.usefixtures("needs_triton")
def test_silu_quant_fusion_gives_the_unfused_logits(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """silu_quant: an fp8 down projection of a prompt step (more tokens than the small-M path takes) gets its input
    made and quantized in one kernel; the logits are the unfused path's exactly, and a decode step's one token keeps
    the small-M path."""
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need compute capability 8.9")
    calls: list[int] = []
    real = quantization_module.silu_and_mul_quantize_fp8_triton

    def spy(gate_up: torch.Tensor):  # type: ignore[no-untyped-def]
        calls.append(gate_up.shape[0])
        return real(gate_up)

    monkeypatch.setattr(quantization_module, "silu_and_mul_quantize_fp8_triton", spy)
    prompt = list(range(300, 319))
    torch.manual_seed(0)
    unfused = _runner("fp8", "all", device)
    torch.manual_seed(0)
    fused = _runner("fp8", "all+silu_quant", device)
    with torch.inference_mode():
        expected = _prefill_then_decode(unfused, prompt)
        assert calls == []
        got = _prefill_then_decode(fused, prompt)
    assert calls == [len(prompt)] * fused.model.num_layers  # the prompt step's down projections only
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)


@pytest.mark.usefixtures("needs_triton")
def test_norm_quant_fusion_gives_the_unfused_logits(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_quant: an fp8 qkv or gate_up projection of a prompt step gets its input normalised and quantized in one
    kernel (the first layer's qkv without a residual); the logits are the unfused path's exactly, and a decode step's
    one token keeps the small-M path."""
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need compute capability 8.9")
    calls: list[tuple[int, bool]] = []
    real = quantization_module.add_rms_norm_quantize_fp8_triton

    def spy(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):  # type: ignore[no-untyped-def]
        calls.append((x.shape[0], residual is not None))
        return real(x, residual, weight, eps)

    monkeypatch.setattr(quantization_module, "add_rms_norm_quantize_fp8_triton", spy)
    prompt = list(range(300, 319))
    torch.manual_seed(0)
    unfused = _runner("fp8", "all", device)
    torch.manual_seed(0)
    fused = _runner("fp8", "all+norm_quant", device)
    with torch.inference_mode():
        expected = _prefill_then_decode(unfused, prompt)
        assert calls == []
        got = _prefill_then_decode(fused, prompt)
    assert calls == [(len(prompt), not (layer == 0 and proj == "qkv")) for layer in range(fused.model.num_layers)
                     for proj in ("qkv", "gate_up")]  # the prompt step's only
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)

"""RMSNorm (with the residual add) fused into the small-M linear (`small_m_add_norm_linear_triton`): the same
result as the norm kernel then the linear, the new residual exact, the inputs untouched, every split and tile
shape, int8 (per channel and grouped) and fp8 weights. And SwiGLU's activation fused into it
(`small_m_silu_linear_triton`) against `silu_and_mul` then the linear.

Run: `TRITON_INTERPRET=1 pytest tests/kernels/test_norm_linear.py` (kernels through the interpreter on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from tandem.kernels.quant_linear import QuantWeight
from tandem.kernels.quant_small_m import (
    small_m_add_norm_linear_triton,
    small_m_launch_config,
    small_m_linear_triton,
    small_m_silu_linear_triton,
)
from tandem.kernels.rms_norm import rms_norm_ref
from tandem.kernels.silu_and_mul import silu_and_mul_ref

EPS = 1e-5


def _case(kind: str, n: int, k: int, group_size: int | None, dtype: torch.dtype, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, QuantWeight, torch.Tensor]:
    x = torch.randn(1, k, device=device, dtype=dtype)
    residual = torch.randn(1, k, device=device, dtype=dtype) * 4  # the residual stream is the larger one
    norm_weight = (1 + 0.5 * torch.randn(k, device=device)).to(dtype)
    qw = QuantWeight.quantize(torch.randn(n, k, device=device), kind, group_size=group_size, clip_search=False)
    bias = torch.randn(n, device=device)
    return x, residual, norm_weight, qw, bias


CASES = [  # (kind, N, K, group size, split_k or None for the default): one split, several, a ragged last K tile
    ("int8", 96, 256, None, None),
    ("int8", 40, 1024 + 96, None, 3),
    ("int8", 64, 512, 128, 2),
    ("fp8", 72, 768, None, None),
    ("fp8", 48, 1024, None, 4),
]


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("kind", "n", "k", "group_size", "split_k"), CASES)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add_norm", "norm"])
def test_add_norm_linear_matches_norm_then_linear(kind: str, n: int, k: int, group_size: int | None,
                                                  split_k: int | None, with_residual: bool, dtype: torch.dtype,
                                                  tol: dict[str, float], device: torch.device) -> None:
    x, residual, norm_weight, qw, bias = _case(kind, n, k, group_size, dtype, device)
    config = None
    if split_k is not None:
        config = small_m_launch_config(1, n, k, group_size or 0, 4)._replace(split_k=split_k)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = small_m_add_norm_linear_triton(x, residual if with_residual else None, norm_weight, EPS,
                                                       qw.qweight, qw.scales, bias, config=config)
    if with_residual:
        normed, expected_residual = fused_add_rms_norm_ref(x, residual, norm_weight, EPS)
        assert new_residual.data_ptr() != residual.data_ptr()
    else:
        normed, expected_residual = rms_norm_ref(x, norm_weight, EPS), x
        assert new_residual is x  # nothing added: the input is the residual
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
    assert torch.equal(new_residual, expected_residual)  # the sum is exact, rounded as HF rounds it
    expected = small_m_linear_triton(normed, qw.qweight, qw.scales, bias, config=config)
    assert out.shape == (1, n) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol)
    # and against the float product, so the pair above cannot agree on a wrong answer (bf16 output: its rounding,
    # 2^-8 relative)
    exact = normed.double() @ qw.dequantize().double().T + bias.double()
    torch.testing.assert_close(out.double(), exact, atol=1e-3 if dtype == torch.float32 else 5e-2,
                               rtol=1e-3 if dtype == torch.float32 else 8e-3)


@pytest.mark.usefixtures("needs_triton")
def test_add_norm_linear_rejects_what_it_cannot_fuse(device: torch.device) -> None:
    x, residual, norm_weight, qw, _ = _case("int8", 32, 256, None, torch.float32, device)
    with pytest.raises(ValueError, match="one row"):
        small_m_add_norm_linear_triton(x.repeat(2, 1), residual.repeat(2, 1), norm_weight, EPS, qw.qweight, qw.scales)
    with pytest.raises(ValueError, match="norm_weight shape"):
        small_m_add_norm_linear_triton(x, residual, norm_weight[:-1], EPS, qw.qweight, qw.scales)
    with pytest.raises(ValueError, match="residual"):
        small_m_add_norm_linear_triton(x, residual.double(), norm_weight, EPS, qw.qweight, qw.scales)
    tensor_cores = small_m_launch_config(1, 32, 256, 0, 4, fma_max_m=0)
    with pytest.raises(ValueError, match="CUDA cores"):
        small_m_add_norm_linear_triton(x, residual, norm_weight, EPS, qw.qweight, qw.scales, config=tensor_cores)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("kind", "n", "k", "group_size", "split_k"), CASES)
def test_silu_linear_matches_silu_then_linear(kind: str, n: int, k: int, group_size: int | None,
                                              split_k: int | None, dtype: torch.dtype, tol: dict[str, float],
                                              device: torch.device) -> None:
    _, _, _, qw, bias = _case(kind, n, k, group_size, dtype, device)
    gate_up = torch.randn(1, 2 * k, device=device, dtype=dtype) * 2
    config = None
    if split_k is not None:
        config = small_m_launch_config(1, n, k, group_size or 0, 4)._replace(split_k=split_k)
    before = gate_up.clone()
    out = small_m_silu_linear_triton(gate_up, qw.qweight, qw.scales, bias, config=config)
    assert torch.equal(gate_up, before)
    activation = silu_and_mul_ref(gate_up)
    expected = small_m_linear_triton(activation, qw.qweight, qw.scales, bias, config=config)
    assert out.shape == (1, n) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol)
    exact = activation.double() @ qw.dequantize().double().T + bias.double()
    torch.testing.assert_close(out.double(), exact, atol=1e-3 if dtype == torch.float32 else 5e-2,
                               rtol=1e-3 if dtype == torch.float32 else 8e-3)


@pytest.mark.usefixtures("needs_triton")
def test_silu_linear_rejects_what_it_cannot_fuse(device: torch.device) -> None:
    _, _, _, qw, _ = _case("int8", 32, 256, None, torch.float32, device)
    with pytest.raises(ValueError, match=r"\[1, 2K\]"):
        small_m_silu_linear_triton(torch.randn(1, 256, device=device), qw.qweight, qw.scales)
    with pytest.raises(ValueError, match=r"\[1, 2K\]"):
        small_m_silu_linear_triton(torch.randn(2, 512, device=device), qw.qweight, qw.scales)
    tensor_cores = small_m_launch_config(1, 32, 256, 0, 4, fma_max_m=0)
    with pytest.raises(ValueError, match="CUDA cores"):
        small_m_silu_linear_triton(torch.randn(1, 512, device=device), qw.qweight, qw.scales, config=tensor_cores)

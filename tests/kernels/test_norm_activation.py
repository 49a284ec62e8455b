"""rms_norm, fused_add_rms_norm, silu_and_mul: kernel vs reference, reference vs HF / naive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tandem.kernels.fused_add_rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton
from tandem.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from tandem.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton

# (T, H): one token, and token/hidden counts that are not powers of two.
NORM_SHAPES = [(1, 64), (7, 96), (37, 200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rms_norm_ref_matches_hf(dtype: torch.dtype) -> None:
    x = torch.randn(7, 96, dtype=dtype)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
        expected = hf(x)
    torch.testing.assert_close(rms_norm_ref(x, hf.weight, 1e-5), expected, atol=0, rtol=0)


def test_fused_add_rms_norm_ref_is_add_then_norm() -> None:
    x, residual, weight = torch.randn(7, 96), torch.randn(7, 96), torch.randn(96)
    normed, new_residual = fused_add_rms_norm_ref(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, rms_norm_ref(x + residual, weight, 1e-6))


def test_silu_and_mul_ref_matches_naive() -> None:
    x = torch.randn(5, 2 * 48)
    gate, up = x[:, :48], x[:, 48:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_kernel(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                         tol: dict[str, float]) -> None:
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    weight = torch.randn(shape[1], dtype=dtype, device=device)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **tol)


@pytest.mark.usefixtures("needs_triton")
def test_rms_norm_kernel_strided_rows(device: torch.device) -> None:
    # A row slice of a wider buffer: rows are read by stride, not assumed packed.
    wide = torch.randn(6, 160, device=device)
    x, weight = wide[:, :100], torch.randn(100, device=device)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_fused_add_rms_norm_kernel(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                                   tol: dict[str, float]) -> None:
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[1], dtype=dtype, device=device)
    expected_normed, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    normed, new_residual = fused_add_rms_norm_triton(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual, **tol)
    torch.testing.assert_close(normed, expected_normed, **tol)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("shape", [(1, 16), (7, 96), (37, 1100)], ids=str)
def test_silu_and_mul_kernel(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                             tol: dict[str, float]) -> None:
    # 1100 > 1024: a row spans several column blocks, the last one ragged.
    x = torch.randn(shape[0], 2 * shape[1], dtype=dtype, device=device) * 4
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tol)


@pytest.mark.usefixtures("needs_triton")
def test_empty_batch(device: torch.device) -> None:
    x, weight = torch.empty(0, 64, device=device), torch.ones(64, device=device)
    assert rms_norm_triton(x, weight, 1e-5).shape == (0, 64)
    assert silu_and_mul_triton(torch.empty(0, 64, device=device)).shape == (0, 32)


@pytest.mark.usefixtures("needs_triton")
def test_unsupported_shapes_raise(device: torch.device) -> None:
    with pytest.raises(ValueError, match="too large"):
        rms_norm_triton(torch.randn(1, 20000, device=device), torch.ones(20000, device=device), 1e-5)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_triton(torch.randn(2, 64, device=device), torch.ones(63, device=device), 1e-5)
    with pytest.raises(ValueError, match="not even"):
        silu_and_mul_triton(torch.randn(2, 63, device=device))


def test_reference_bf16_stays_bf16() -> None:
    x = torch.randn(3, 2 * 32, dtype=torch.bfloat16)
    assert silu_and_mul_ref(x).dtype == torch.bfloat16
    assert rms_norm_ref(x, torch.ones(64, dtype=torch.bfloat16), 1e-5).dtype == torch.bfloat16
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(x[:, :32]) * x[:, 32:])

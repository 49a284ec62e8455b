"""Residual add fused with the next RMSNorm: one read of x and residual, one write of each."""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, pdl_prologue, tl, triton, use_pdl
from tandem.kernels.rms_norm import _rms_normalize, rms_norm_ref, row_block_config


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr,
    stride_x, stride_residual,
    hidden_size, eps,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # In place: each program reads its row of both inputs before it writes that row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    # HF adds in the model dtype: round the new residual stream before normalising it.
    new_residual = (x + residual).to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + row * stride_residual + cols, new_residual, mask=mask)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = _rms_normalize(new_residual.to(tl.float32), weight, hidden_size, eps, x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * stride_x + cols, normed, mask=mask)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(x + residual) [T, H], x + residual [T, H]).

    In place: the normalised rows overwrite `x` and the sum overwrites `residual`, which are returned.
    """
    check_launchable("fused_add_rms_norm", x, residual, weight)
    check_last_dim_contiguous("fused_add_rms_norm", x=x, residual=residual, weight=weight)
    num_tokens, hidden_size = x.shape
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} "
                         f"must match x {tuple(x.shape)} {x.dtype}")
    if weight.shape != (hidden_size,):
        raise ValueError(f"fused_add_rms_norm: weight shape {tuple(weight.shape)} != ({hidden_size},)")
    if num_tokens == 0:
        return x, residual
    block_h, num_warps = row_block_config("fused_add_rms_norm", hidden_size, x.element_size())
    pdl = use_pdl(x.device)
    _fused_add_rms_norm_kernel[(num_tokens,)](
        x, residual, weight, x.stride(0), residual.stride(0), hidden_size, eps,
        BLOCK_H=block_h, USE_PDL=pdl, launch_pdl=pdl, num_warps=num_warps,
    )
    return x, residual


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(x + residual), x + residual); inputs are left untouched."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual

"""RMSNorm as HF Llama computes it: `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`."""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, pdl_prologue, tl, triton, use_pdl


@triton.jit
def _rms_normalize(x, weight, hidden_size, eps, out_dtype: tl.constexpr):
    """Normalise one fp32 row; shared with fused_add_rms_norm so the two round identically."""
    variance = tl.sum(x * x, axis=0) / hidden_size
    # HF rounds the normalised row to the model dtype before the weight multiplies it.
    normed = (x * tl.rsqrt(variance + eps)).to(out_dtype).to(tl.float32)
    return (normed * weight.to(tl.float32)).to(out_dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr,
    stride_x, stride_out,
    hidden_size, eps,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # One program per row: a row (≤ 32k elements) fits in registers, so x is read exactly once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = _rms_normalize(x, weight, hidden_size, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def row_block_config(op: str, hidden_size: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for a one-row-per-program kernel; rejects rows that cannot fit."""
    block_h = triton.next_power_of_2(hidden_size)
    # As in Triton's layer-norm tutorial: beyond 64 KB a row no longer fits one program's registers.
    if block_h * element_size > 65536:
        raise ValueError(f"{op}: hidden size {hidden_size} too large for a one-row kernel")
    return block_h, min(max(block_h // 256, 1), 8)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H] in x.dtype."""
    check_launchable("rms_norm", x, weight)
    check_last_dim_contiguous("rms_norm", x=x, weight=weight)
    num_tokens, hidden_size = x.shape
    if weight.shape != (hidden_size,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({hidden_size},)")
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    block_h, num_warps = row_block_config("rms_norm", hidden_size, x.element_size())
    pdl = use_pdl(x.device)
    _rms_norm_kernel[(num_tokens,)](
        x, weight, out, x.stride(0), out.stride(0), hidden_size, eps, BLOCK_H=block_h,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=num_warps,
    )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H] in x.dtype (HF LlamaRMSNorm)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)

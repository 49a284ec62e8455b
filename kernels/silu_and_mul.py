"""SwiGLU's activation: silu(gate) * up, reading the fused gate_up projection once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, pdl_prologue, tl, triton, use_pdl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_out,
    intermediate_size,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # Grid (T, column blocks): rows of 14k columns are split so short batches still fill the GPU.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's F.silu rounds to the model dtype before the product; do the same so bf16 matches.
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> [T, I]."""
    check_launchable("silu_and_mul", x)
    check_last_dim_contiguous("silu_and_mul", x=x)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: last dimension {width} is not even")
    intermediate_size = width // 2
    out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(intermediate_size), 1024)
    grid = (num_tokens, triton.cdiv(intermediate_size, block))
    pdl = use_pdl(x.device)
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), intermediate_size,
                               BLOCK=block, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

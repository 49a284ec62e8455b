"""Rotary position embedding, neox / HF-Llama style (rotate_half pairs i with i + D/2), in place."""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, tl, triton


@triton.jit
def load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cos_sin, half_dim, BLOCK_HALF: tl.constexpr):
    """The cos and sin halves of one token's row of the cache, each [1, BLOCK_HALF] fp32."""
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half_dim
    cos_sin_row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(cos_sin_row + dims, mask=dim_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_row + half_dim + dims, mask=dim_mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def rotate_heads(ptr, stride_h, num_heads, cos, sin, half_dim,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate all heads of one token in place: [BLOCK_H, BLOCK_HALF] tiles of each half, in fp32.

    Returns the two rotated halves as stored (rounded to x's dtype), and the tile mask, for a caller that
    also writes them elsewhere (`rope_store_kv`)."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < half_dim)[None, :]
    first = ptr + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half_dim, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
    rotated1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    rotated2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(first, rotated1, mask=mask)
    tl.store(first + half_dim, rotated2, mask=mask)
    return rotated1, rotated2, mask


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos_sin,
    num_q_heads, num_kv_heads, half_dim,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: its cos/sin row is loaded once and serves every q and k head.
    token = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cos_sin, half_dim, BLOCK_HALF)  # [1, D/2]
    rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, half_dim, BLOCK_HQ, BLOCK_HALF)
    rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half_dim, BLOCK_HK, BLOCK_HALF)


def check_shapes(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 op: str = "rotary_embedding") -> None:
    """Validate rotary_embedding's arguments (also rope_store_kv's, named `op` in the message)."""
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"{op}: positions {tuple(positions.shape)}, q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)} disagree")
    if head_dim % 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"{op}: cos_sin_cache [P, {cos_sin_cache.shape[1]}] must cover the "
                         f"whole (even) head_dim {head_dim}")


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64, q [T, Hq, D], k [T, Hkv, D], cos_sin_cache [P, D] fp32 -> (q, k), in place.

    q and k may be strided views (e.g. of a fused qkv projection); their last dimension must be dense.
    """
    check_launchable("rotary_embedding", positions, q, k, cos_sin_cache)
    check_last_dim_contiguous("rotary_embedding", q=q, k=k, cos_sin_cache=cos_sin_cache)
    check_shapes(positions, q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    half_dim = head_dim // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, half_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half_dim), num_warps=4,
    )
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, Hq, D], k [T, Hkv, D], cos_sin_cache [P, D] fp32 -> (q, k), rotated in place."""
    check_shapes(positions, q, k, cos_sin_cache)
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    for x in (q, k):
        half_dim = x.shape[-1] // 2
        x1, x2 = x[..., :half_dim].float(), x[..., half_dim:].float()
        rotated1 = x1 * cos - x2 * sin
        rotated2 = x2 * cos + x1 * sin
        # Both halves are computed before either is written: the views alias x.
        x[..., :half_dim] = rotated1
        x[..., half_dim:] = rotated2
    return q, k

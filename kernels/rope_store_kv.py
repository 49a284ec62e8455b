"""Rotary embedding of q and k and the store of the rotated k and v into the paged KV cache, in one launch.

Same contract as `rotary_embedding` followed by `store_kv` (and the same results, bit for bit): q and k are
rotated in place (neox / HF-Llama pairing of i with i + D/2), then k and v go to their slots of the cache
(slot -1 skipped; fp8 caches quantized with static per-kv-head scales, see `fp8_kv`). One program per
token loads its cos/sin row once, rotates its q and k heads, and stores the rotated k tile straight from
registers, so k is not read back by a second kernel.

What it saves, estimated for Llama-3.1-8B (32 layers, Hq 32, Hkv 8, D 128, bf16) on an H200, per decode
step of T tokens (not yet measured on GPU):
- launches: one per layer, 32 per step (of ~330), at any batch. At decode sizes both kernels are all fixed
  cost (rotary moves 20 KB per token): timed alone at T 256 with a cold L2 they took 6.8 and 5.7 us
  (benchmarks/results/kernels-h200.json); back to back in a CUDA graph a dependent tiny kernel costs ~2-5
  us. So ~60-160 us per step: 2-4% of a batch-1 step (~3.8 ms of weight reads at 4.25 TB/s) and 1-2.5% of
  a batch-64 step at 1k context (~3.8 ms of weights + ~2.5 ms of KV reads). Eagerly (batches above the
  largest graph bucket) it also saves one Python wrapper call per layer (checks plus Triton's launcher).
- bytes: k is read once instead of twice, T * Hkv * D * 2 B = 2 KB per token per layer: 64 KB per step at
  batch 1 and 4 MB at batch 64 (~1 us at 4.25 TB/s, and mostly an L2 hit in the unfused pair anyway).
So the win is the launch count; the bytes are noise.
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, pdl_prologue, tl, triton, use_pdl
from tandem.kernels.rotary_embedding import check_shapes as check_rotary_shapes
from tandem.kernels.rotary_embedding import load_cos_sin, rotary_embedding_ref, rotate_heads
from tandem.kernels.store_kv import cache_arg, store_kv_ref, store_kv_tile
from tandem.kernels.store_kv import check_shapes as check_store_shapes


@triton.jit
def _rope_store_kv_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos_sin,
    stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    num_q_heads, num_kv_heads, half_dim, block_size,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # One program per token; every tile is [heads, D/2], the two halves of the head dimension.
    token = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cos_sin, half_dim, BLOCK_HALF)  # [1, D/2]
    rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, half_dim, BLOCK_HQ, BLOCK_HALF)
    # The rotated k as written to k (rounded to its dtype): what store_kv would read back.
    k1, k2, mask = rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half_dim,
                                BLOCK_HK, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token of a CUDA graph: rotated, but nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_HK)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    head_mask = heads < num_kv_heads
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_offset + heads * stride_kc_head + dims
    store_kv_tile(k_dst, k1, k_scale_ptr, heads, head_mask, mask, IS_FP8)
    store_kv_tile(k_dst + half_dim, k2, k_scale_ptr, heads, head_mask, mask, IS_FP8)
    v_src = v_ptr + token * stride_vt + heads * stride_vh + dims
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_offset + heads * stride_vc_head + dims
    store_kv_tile(v_dst, tl.load(v_src, mask=mask), v_scale_ptr, heads, head_mask, mask, IS_FP8)
    store_kv_tile(v_dst + half_dim, tl.load(v_src + half_dim, mask=mask), v_scale_ptr, heads, head_mask, mask,
                  IS_FP8)


def _check_shapes(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """rotary_embedding's and store_kv's checks; whether the cache is fp8."""
    check_rotary_shapes(positions, q, k, cos_sin_cache, op="rope_store_kv")
    return check_store_shapes("rope_store_kv", k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rope_store_kv_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64, q [T, Hq, D], k, v [T, Hkv, D], cos_sin_cache [P, D] fp32, k_cache, v_cache
    [N, B, Hkv, D], slot_mapping [T] -> (q, k), rotated in place; the rotated k and v stored at their slots.

    = rotary_embedding(positions, q, k, cos_sin_cache); store_kv(k, v, k_cache, v_cache, slot_mapping,
    k_scale, v_scale). q, k and v may be strided views (e.g. of a fused qkv projection) with a dense last
    dimension. A float8_e4m3fn cache needs k_scale, v_scale [Hkv] float32.

    Launch: one program per token, 4 warps, as rotary_embedding and store_kv (a Llama-8B token is a
    [32, 64] q tile and [8, 64] k and v tiles per half: 1-2 registers' worth per thread; not yet measured
    on GPU).
    """
    op = "rope_store_kv"
    check_launchable(op, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    check_last_dim_contiguous(op, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, k_cache=k_cache, v_cache=v_cache)
    is_fp8 = _check_shapes(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    half_dim = head_dim // 2
    pdl = use_pdl(q.device)
    _rope_store_kv_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, cache_arg(k_cache, is_fp8), cache_arg(v_cache, is_fp8), slot_mapping,
        k_scale if is_fp8 else slot_mapping, v_scale if is_fp8 else slot_mapping,  # unread unless fp8
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads, half_dim, k_cache.shape[1],
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half_dim), IS_FP8=is_fp8, USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
    )
    return q, k


def rope_store_kv_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the Triton version: the two references, one after the other."""
    _check_shapes(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    q, k = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k

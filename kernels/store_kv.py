"""Write the new tokens' keys and values into the paged KV cache at their flat slots.

The cache holds the model's dtype, or float8_e4m3fn with static per-kv-head scales (`fp8_kv`): then
each value is stored as e4m3(x / scale[head]), quantized in the same pass.
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, tl, triton
from tandem.kernels.fp8_kv import check_kv_cache, quantize_e4m3, quantize_kv


@triton.jit
def store_kv_tile(dst, x, scale_ptr, heads, head_mask, mask, IS_FP8: tl.constexpr):
    """Store an [H, D'] tile x at the pointers dst: as is, or (IS_FP8: dst is the cache's uint8 view) as
    e4m3 codes of x / scale_ptr[heads]; heads and head_mask are [H, 1]."""
    if IS_FP8:
        scale = tl.load(scale_ptr + heads, mask=head_mask, other=1.0)
        tl.store(dst, quantize_e4m3(x.to(tl.float32), scale), mask=mask)
    else:
        tl.store(dst, x, mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
):
    # One program per token moves its [Hkv, D] key and value tiles.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token of a CUDA graph: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    head_mask = heads < num_kv_heads
    mask = head_mask & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_offset + heads * stride_kc_head + dims
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_offset + heads * stride_vc_head + dims
    store_kv_tile(k_dst, k, k_scale_ptr, heads, head_mask, mask, IS_FP8)
    store_kv_tile(v_dst, v, v_scale_ptr, heads, head_mask, mask, IS_FP8)


def check_shapes(op: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Validate store_kv's arguments (also rope_store_kv's); whether the cache is fp8."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"{op}: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} disagree")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"{op}: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold "
                         f"[N, B, {num_kv_heads}, {head_dim}]")
    if v.dtype != k.dtype:
        raise ValueError(f"{op}: v dtype {v.dtype} != k dtype {k.dtype}")
    return check_kv_cache(op, k_cache, v_cache, k_scale, v_scale, k.dtype, "key/value")


def cache_arg(cache: torch.Tensor, is_fp8: bool) -> torch.Tensor:
    """What a writer kernel gets for a cache: fp8 pages as uint8, the codes `quantize_e4m3` makes."""
    return cache.view(torch.uint8) if is_fp8 else cache


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [N, B, Hkv, D] at slot_mapping [T] (block s // B, offset s % B).

    A slot of -1 is skipped. Slots are not bounds-checked (that would need a host sync). A float8_e4m3fn
    cache needs k_scale, v_scale [Hkv] float32 (x is stored as e4m3(clamp(x / scale, +-448))); any other
    cache must have k's dtype and no scales.
    """
    check_launchable("store_kv", k, v, k_cache, v_cache, slot_mapping)
    check_last_dim_contiguous("store_kv", k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    is_fp8 = check_shapes("store_kv", k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, cache_arg(k_cache, is_fp8), cache_arg(v_cache, is_fp8), slot_mapping,
        k_scale if is_fp8 else slot_mapping, v_scale if is_fp8 else slot_mapping,  # unread unless fp8
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8, num_warps=4,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [N, B, Hkv, D] at slot_mapping [T]; a slot of -1 is skipped.
    Same contract as the Triton version (fp8 included, same codes bit for bit)."""
    is_fp8 = check_shapes("store_kv", k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]
    is_stored = slot_mapping >= 0
    slots = slot_mapping[is_stored]  # boolean indexing syncs on GPU; fine for the reference
    blocks, offsets = slots // block_size, slots % block_size
    k_new, v_new = k[is_stored], v[is_stored]
    if is_fp8:
        assert k_scale is not None and v_scale is not None
        # Through uint8 views: index_put on fp8 tensors is not implemented on every device.
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_new = quantize_kv(k_new, k_scale).view(torch.uint8)
        v_new = quantize_kv(v_new, v_scale).view(torch.uint8)
    # Advanced-index assignment writes through, whatever the caches' strides.
    k_cache[blocks, offsets] = k_new
    v_cache[blocks, offsets] = v_new


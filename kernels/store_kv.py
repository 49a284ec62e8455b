"""Write the new tokens' keys and values into the paged KV cache at their flat slots."""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, tl, triton


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_offset + heads * stride_kc_head + dims
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_offset + heads * stride_vc_head + dims
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def _check_shapes(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} disagree")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"store_kv: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold "
                         f"[N, B, {num_kv_heads}, {head_dim}]")
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise ValueError(f"store_kv: cache dtype {k_cache.dtype} != key/value dtype {k.dtype}")


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [N, B, Hkv, D] at slot_mapping [T] (block s // B, offset s % B).

    A slot of -1 is skipped. Slots are not bounds-checked (that would need a host sync).
    """
    check_launchable("store_kv", k, v, k_cache, v_cache, slot_mapping)
    check_last_dim_contiguous("store_kv", k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    _check_shapes(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [N, B, Hkv, D] at slot_mapping [T]; a slot of -1 is skipped."""
    _check_shapes(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    is_stored = slot_mapping >= 0
    slots = slot_mapping[is_stored]  # boolean indexing syncs on GPU; fine for the reference
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced-index assignment writes through, whatever the caches' strides.
    k_cache[blocks, offsets] = k[is_stored]
    v_cache[blocks, offsets] = v[is_stored]

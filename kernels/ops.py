"""The eight fused ops the model code calls, as one swappable bundle: pure torch or Triton."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels import _triton
from tandem.kernels.fused_add_rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton
from tandem.kernels.paged_decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
from tandem.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton
from tandem.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from tandem.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from tandem.kernels.rotary_embedding import rotary_embedding_ref, rotary_embedding_triton
from tandem.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from tandem.kernels.store_kv import store_kv_ref, store_kv_triton


@dataclass(frozen=True)
class Ops:
    """Signatures (shapes per op module's docstrings):

    rms_norm(x, weight, eps) -> out
    fused_add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)   # may reuse x and residual
    silu_and_mul(x) -> out
    rotary_embedding(positions, q, k, cos_sin_cache) -> (q, k)               # in place
    store_kv(k, v, k_cache, v_cache, slot_mapping) -> None
    prefill_attention(q, k, v, cu_seqlens, max_seqlen, scale) -> out
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None) -> out
    paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale) -> out
    """

    name: str
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    store_kv: Callable[..., None]
    prefill_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]


_TORCH_OPS = Ops(
    name="torch",
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    silu_and_mul=silu_and_mul_ref,
    rotary_embedding=rotary_embedding_ref,
    store_kv=store_kv_ref,
    prefill_attention=prefill_attention_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
)

_TRITON_OPS = Ops(
    name="triton",
    rms_norm=rms_norm_triton,
    fused_add_rms_norm=fused_add_rms_norm_triton,
    silu_and_mul=silu_and_mul_triton,
    rotary_embedding=rotary_embedding_triton,
    store_kv=store_kv_triton,
    prefill_attention=prefill_attention_triton,
    paged_decode_attention=paged_decode_attention_triton,
    paged_prefill_attention=paged_prefill_attention_triton,
)


def get_ops(backend: str) -> Ops:
    """"torch": the pure-torch references (any device); "triton": the fused kernels."""
    if backend == "torch":
        return _TORCH_OPS
    if backend == "triton":
        if not _triton.HAS_TRITON:
            raise RuntimeError("kernel backend 'triton' requested but triton is not installed")
        return _TRITON_OPS
    raise ValueError(f"unknown kernel backend {backend!r} (torch, triton)")


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with triton, or Triton's interpreter."""
    if not _triton.HAS_TRITON:
        return False
    return device.type == "cuda" or _triton.IS_INTERPRETING

"""The fused ops the model code calls, as one swappable bundle: pure torch or Triton.

Fusions (Triton only; the references are the same arithmetic either way). Each one is an implementation choice for
an op the model calls, so that its effect can be measured alone (`python -m tandem.benchmarks.gpu_engine
decode-latency --fusions ...`); the model's code does not change with them:

    rope_store    rope_store_kv: RoPE of q and k and the store of k and v into the pages in one kernel
                  (unfused: rotary_embedding, then store_kv)
    add_norm      fused_add_rms_norm: the residual add inside the RMSNorm kernel (unfused: a torch add, then
                  rms_norm)
    attn_combine  paged_decode_attention with context splits: the last split of each (sequence, kv head) merges
                  them in the split kernel (unfused: a second, combine kernel). Opt-in, not in "all": on an H200
                  it matched the reference path but was 3-6% slower per decode step (results README, fusions)
    norm_linear   the RMSNorm (and its residual add) before a layer's qkv and gate_up projections inside the
                  projection's launch, where the projection can take it: a quantized layer's small-M GEMV at one
                  token (`QuantizedLinear.add_norm_forward`; each program recomputes the row's RMS). Opt-in: on
                  an H100 it made the 8B batch-1 step 2-3% slower (results README, 2026-12-07 third session)
    silu_linear   SwiGLU's activation inside the down projection's launch, where the projection can take it: a
                  quantized layer's small-M GEMV at one token (`QuantizedLinear.silu_forward`; each program makes
                  its own K slice of silu(gate) * up, no full-row pass). Opt-in: 0-0.5% on an H100's 8B batch-1 step
    silu_quant    SwiGLU's activation and the per-token fp8 quantization of the down projection's input in one
                  kernel, for an fp8 layer's W8A8 GEMM (prompt steps: above the small-M limit;
                  `QuantizedLinear.silu_quant_forward`, `silu_and_mul_quantize_fp8_triton`): the [T, I] activation
                  is never written in bf16 and read back. Bit for bit the unfused result. Opt-in: no gain on an H100
                  (#18's fp8 + fp8 KV offline run, 5,026 against 5,062 tok/s)
    norm_quant    the RMSNorm (with its residual add) before the qkv and gate_up projections and the per-token fp8
                  quantization of its output in one kernel, for an fp8 layer's W8A8 GEMM (prompt steps;
                  `QuantizedLinear.add_norm_quant_forward`, `add_rms_norm_quantize_fp8_triton`): the normalised row
                  is never written in bf16 and read back. Bit for bit the unfused result. Opt-in until measured (an
                  fp8 4,096-token prompt step on an H100 spends 6.1 of its 74.1 ms quantizing activations, 64 of the
                  128 launches for these two projections' inputs, about a third of the bytes)

`get_ops("triton", fusions)` takes "all" (rope_store and add_norm: the default), "none", or names joined by "," or
"+" ("all+attn_combine"); without `fusions`, from $TANDEM_FUSIONS (the same syntax), which reaches every engine a
process builds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.kernels import _triton
from tandem.kernels.fused_add_rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton
from tandem.kernels.paged_decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
from tandem.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton
from tandem.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from tandem.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from tandem.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton
from tandem.kernels.rotary_embedding import rotary_embedding_ref, rotary_embedding_triton
from tandem.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from tandem.kernels.store_kv import store_kv_ref, store_kv_triton

FUSIONS = ("rope_store", "add_norm")  # "all", in this order
OPT_IN_FUSIONS = ("attn_combine", "norm_linear", "silu_linear", "silu_quant", "norm_quant")  # only when named
FUSIONS_ENV = "TANDEM_FUSIONS"


@dataclass(frozen=True)
class Ops:
    """Signatures (shapes per op module's docstrings):

    rms_norm(x, weight, eps) -> out
    fused_add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)   # may reuse x and residual
    silu_and_mul(x) -> out
    rotary_embedding(positions, q, k, cos_sin_cache) -> (q, k)               # in place
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None
    rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)
        -> (q, k)                                                            # rotary_embedding, then store_kv
    prefill_attention(q, k, v, cu_seqlens, max_seqlen, scale, out=None) -> out
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None, out=None) -> out
    paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale,
                            out=None) -> out
    (the attention ops write into `out` where given: a view of q's shape and dtype, so that a step's decode tokens
    and prompt chunks fill one buffer)

    `fusions`: the fusions this bundle launches (of FUSIONS and OPT_IN_FUSIONS; none for the references).
    """

    name: str
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    store_kv: Callable[..., None]
    rope_store_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    prefill_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    fusions: frozenset[str] = field(default=frozenset())


def parse_fusions(spec: str | Iterable[str]) -> frozenset[str]:
    """"all" | "none" | "" | names of FUSIONS or OPT_IN_FUSIONS joined by "," or "+" (or an iterable of names)
    -> the set."""
    names = spec.replace("+", ",").split(",") if isinstance(spec, str) else list(spec)
    chosen: set[str] = set()
    for name in (n.strip() for n in names):
        if name == "all":
            chosen.update(FUSIONS)
        elif name not in ("none", ""):
            if name not in FUSIONS + OPT_IN_FUSIONS:
                raise ValueError(f"unknown fusion {name!r} (all, none, or of {', '.join(FUSIONS + OPT_IN_FUSIONS)})")
            chosen.add(name)
    return frozenset(chosen)


def fusions_label(fusions: frozenset[str]) -> str:
    """The set as `parse_fusions` reads it back: "none", or "all" and names, or names, joined by "+"."""
    names = [name for name in FUSIONS + OPT_IN_FUSIONS if name in fusions]
    if set(FUSIONS) <= fusions:
        names = ["all", *(name for name in OPT_IN_FUSIONS if name in fusions)]
    return "+".join(names) or "none"


def _rope_then_store(rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]], store: Callable[..., None]
                     ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """rope_store_kv as two launches (the fusion off)."""
    def rope_store_kv_unfused(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rotary(positions, q, k, cos_sin_cache)
        store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q, k
    return rope_store_kv_unfused


def _add_then_norm(rms_norm: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """fused_add_rms_norm as two launches (the fusion off): the same sum, rounded to the dtype, then the norm."""
    def fused_add_rms_norm_unfused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
        new_residual = x + residual
        return rms_norm(new_residual, weight, eps), new_residual
    return fused_add_rms_norm_unfused


def paged_decode_attention_one_launch(*args: Any, **kwargs: Any) -> torch.Tensor:
    """paged_decode_attention_triton with its splits merged in the split kernel (the attn_combine fusion)."""
    return paged_decode_attention_triton(*args, combine_in_kernel=True, **kwargs)


_TORCH_OPS = Ops(
    name="torch",
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    silu_and_mul=silu_and_mul_ref,
    rotary_embedding=rotary_embedding_ref,
    store_kv=store_kv_ref,
    rope_store_kv=rope_store_kv_ref,
    prefill_attention=prefill_attention_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
)


@functools.cache
def _triton_ops(fusions: frozenset[str]) -> Ops:
    """One bundle per set of fusions (cached: the same set gives the same object)."""
    return Ops(
        name="triton",
        rms_norm=rms_norm_triton,
        fused_add_rms_norm=(fused_add_rms_norm_triton if "add_norm" in fusions else _add_then_norm(rms_norm_triton)),
        silu_and_mul=silu_and_mul_triton,
        rotary_embedding=rotary_embedding_triton,
        store_kv=store_kv_triton,
        rope_store_kv=(rope_store_kv_triton if "rope_store" in fusions
                       else _rope_then_store(rotary_embedding_triton, store_kv_triton)),
        prefill_attention=prefill_attention_triton,
        paged_decode_attention=(paged_decode_attention_one_launch if "attn_combine" in fusions
                                else paged_decode_attention_triton),
        paged_prefill_attention=paged_prefill_attention_triton,
        fusions=fusions,
    )


def get_ops(backend: str, fusions: str | Iterable[str] | None = None) -> Ops:
    """"torch": the pure-torch references (any device); "triton": the kernels, with `fusions` (default
    $TANDEM_FUSIONS, else "all"; see the module docstring). The references take no fusions (a name is still
    checked)."""
    chosen = parse_fusions(os.environ.get(FUSIONS_ENV, "all") if fusions is None else fusions)
    if backend == "torch":
        return _TORCH_OPS
    if backend == "triton":
        if not _triton.HAS_TRITON:
            raise RuntimeError("kernel backend 'triton' requested but triton is not installed")
        return _triton_ops(chosen)
    raise ValueError(f"unknown kernel backend {backend!r} (torch, triton)")


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with triton, or Triton's interpreter."""
    if not _triton.HAS_TRITON:
        return False
    return device.type == "cuda" or _triton.IS_INTERPRETING

"""Llama-family decoder over a paged KV cache.

Reads like the paper: embed → N × (norm → attention → norm → SwiGLU MLP) → norm → logits.
Q/K/V and gate/up are merged into one GEMM each; every elementwise step goes through `Ops`, which
is either the fused Triton kernels or their pure-torch references (same contract, same results).
Parameter names follow the HF checkpoint except the two merged projections (see weights.py). With
`ModelConfig.quantization` the four projections of each layer are `QuantizedLinear`s (tandem.engine.quantization,
swapped in at load); with an fp8 KV cache each attention reads its layer's static K/V scales (`set_kv_scales`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.common.config import ModelConfig
from tandem.engine.attention import AttentionMetadata, KVLayer
from tandem.kernels import Ops
from tandem.kernels.fp8_kv import dequantize_kv, quantize_kv


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, layer_idx: int) -> None:
        super().__init__()
        self.ops = ops
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        # fp8 KV cache: this layer's static K and V scales, each [Hkv] float32 (views of the cache's); else None.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv: KVLayer,
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = kv
        k_scale, v_scale = self.k_scale, self.v_scale
        # RoPE of q and k in place, then k and v into their pages (one kernel with the rope_store fusion).
        q, k = self.ops.rope_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping,
                                      k_scale, v_scale)
        for peer_layers, peer_slots in meta.kv_mirrors:
            # The same K/V (k as rotated above) straight into a decode worker's pages: one more store, no copy
            # afterwards. Its pool has our KV layout (dtype included), and fp8 scales are the same static values
            # everywhere.
            peer_k, peer_v = peer_layers[self.layer_idx]
            self.ops.store_kv(k, v, peer_k, peer_v, peer_slots, k_scale, v_scale)
        if not meta.is_prefill:  # a pure decode step (what CUDA graphs capture)
            assert meta.block_tables is not None and meta.context_lens is not None
            out = self.ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                  self.scale, meta.num_splits, k_scale=k_scale, v_scale=v_scale)
        else:
            out = self._prefill_attention(q, k, v, kv, meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer,
                           meta: AttentionMetadata) -> torch.Tensor:
        """A step with prompt chunks: its leading decode tokens through the decode kernel, the chunks through the
        contiguous prefill kernel (all at position 0) or the paged one (with context)."""
        assert meta.cu_seqlens is not None
        k_cache, v_cache = kv
        k_scale, v_scale = self.k_scale, self.v_scale
        num_decode = meta.num_decode_tokens
        q_chunks = q[num_decode:]
        if meta.seq_lens is not None:
            assert meta.prefill_block_tables is not None
            out = self.ops.paged_prefill_attention(q_chunks, k_cache, v_cache, meta.prefill_block_tables,
                                                   meta.cu_seqlens, meta.seq_lens, meta.max_seqlen, self.scale,
                                                   k_scale=k_scale, v_scale=v_scale)
        else:
            k_new, v_new = k[num_decode:], v[num_decode:]
            if k_scale is not None and v_scale is not None:
                # fp8 cache: attend to the keys and values as stored, as every later chunk and decode step reads
                # them, so that a prompt's result does not depend on how it was chunked (or prefix-cached).
                k_new, v_new = _as_stored(k_new, k_scale), _as_stored(v_new, v_scale)
            out = self.ops.prefill_attention(q_chunks, k_new, v_new, meta.cu_seqlens, meta.max_seqlen, self.scale)
        if num_decode == 0:
            return out
        assert meta.block_tables is not None and meta.context_lens is not None
        decoded = self.ops.paged_decode_attention(q[:num_decode], k_cache, v_cache, meta.block_tables,
                                                  meta.context_lens, self.scale, meta.num_splits,
                                                  k_scale=k_scale, v_scale=v_scale)
        return torch.cat([decoded, out])


def _as_stored(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] as an fp8 cache with per-head `scale` [Hkv] reads it back, in x's dtype."""
    return dequantize_kv(quantize_kv(x, scale), scale).to(x.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, layer_idx: int) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = LlamaAttention(config, ops, layer_idx)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv: KVLayer, meta: AttentionMetadata, cos_sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            # The residual add rides along with the norm: one pass over the activations, not two.
            hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn(positions, hidden, kv, meta, cos_sin)
        norm = self.post_attention_layernorm
        hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.model = LlamaModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: list[KVLayer],
                meta: AttentionMetadata, cos_sin: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states of every token, [T, hidden]. `on_layer_done(i)` runs once layer i's K/V
        are in the cache (the prefill role ships them while the next layer computes)."""
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache[i], meta, cos_sin)
            if on_layer_done is not None:
                on_layer_done(i)
        assert residual is not None
        norm = self.model.norm
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return hidden

    def set_kv_scales(self, scales: torch.Tensor | None) -> None:
        """fp8 KV cache: every attention reads its layer's static K and V scales from `scales` [L, 2, Hkv] float32
        (views: the KV cache owns the tensor); None for a cache in the model's dtype."""
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            assert isinstance(attn, LlamaAttention)
            attn.k_scale, attn.v_scale = (None, None) if scales is None else (scales[i, 0], scales[i, 1])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → [N, vocab] in float32 (sampling and logprobs want full precision)."""
        return self.lm_head(hidden).float()

"""Llama-family decoder over a paged KV cache.

Reads like the paper: embed → N × (norm → attention → norm → SwiGLU MLP) → norm → logits.
Q/K/V and gate/up are merged into one GEMM each; every elementwise step goes through `Ops`, which
is either the fused Triton kernels or their pure-torch references (same contract, same results).
The forward is N + 1 *pieces* (`LlamaForCausalLM.piece`: everything between one attention and the next, with no
host reads) around N attentions (`LlamaAttention.attend`): the eager forward runs them in turn, and
`tandem.engine.cuda_graphs.PiecewiseGraphs` replays the pieces as captured graphs with the attentions eager between
them (a step with prompt tokens: its attention metadata changes shape step to step).
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

    def project(self, positions: torch.Tensor, qkv: torch.Tensor, kv: KVLayer, slot_mapping: torch.Tensor,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k, v [T, Hkv, D] of `qkv_proj`'s output [T, (Hq + 2 Hkv) D], q and k rotated, k and v
        stored into the pages."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = kv
        # RoPE of q and k in place, then k and v into their pages (one kernel with the rope_store fusion).
        q, k = self.ops.rope_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping,
                                      self.k_scale, self.v_scale)
        return q, k, v

    def decode_attend(self, q: torch.Tensor, kv: KVLayer, block_tables: torch.Tensor, context_lens: torch.Tensor,
                      num_splits: int | None, out: torch.Tensor) -> torch.Tensor:
        """Decode tokens' attention: q [S, Hq, D] (one token per sequence) over their pages → `out` [S, Hq, D]."""
        k_cache, v_cache = kv
        return self.ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, self.scale, num_splits,
                                               k_scale=self.k_scale, v_scale=self.v_scale, out=out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
               out: torch.Tensor, with_decode: bool = True) -> torch.Tensor:
        """The attention of `project`'s q, k, v into `out` [T, Hq, D]: decode tokens through the decode kernel
        (unless `with_decode` is False: the caller did theirs), prompt chunks through the contiguous prefill kernel
        (all at position 0) or the paged one (with context)."""
        k_cache, v_cache = kv
        k_scale, v_scale = self.k_scale, self.v_scale
        for peer_layers, peer_slots in meta.kv_mirrors:
            # The same K/V (k as rotated) straight into a decode worker's pages: one more store, no copy
            # afterwards. Its pool has our KV layout (dtype included), and fp8 scales are the same static values
            # everywhere.
            peer_k, peer_v = peer_layers[self.layer_idx]
            self.ops.store_kv(k, v, peer_k, peer_v, peer_slots, k_scale, v_scale)
        num_decode = meta.num_decode_tokens if meta.is_prefill else q.shape[0]
        if num_decode and with_decode:
            assert meta.block_tables is not None and meta.context_lens is not None
            self.decode_attend(q[:num_decode], kv, meta.block_tables, meta.context_lens, meta.num_splits,
                               out[:num_decode])
        if not meta.is_prefill:  # a pure decode step (what the decode graphs capture whole)
            return out
        assert meta.cu_seqlens is not None
        q_chunks, out_chunks = q[num_decode:], out[num_decode:]
        if meta.seq_lens is not None:
            assert meta.prefill_block_tables is not None
            self.ops.paged_prefill_attention(q_chunks, k_cache, v_cache, meta.prefill_block_tables, meta.cu_seqlens,
                                             meta.seq_lens, meta.max_seqlen, self.scale, k_scale=k_scale,
                                             v_scale=v_scale, out=out_chunks)
        else:
            k_new, v_new = k[num_decode:], v[num_decode:]
            if k_scale is not None and v_scale is not None:
                # fp8 cache: attend to the keys and values as stored, as every later chunk and decode step reads
                # them, so that a prompt's result does not depend on how it was chunked (or prefix-cached).
                k_new, v_new = _as_stored(k_new, k_scale), _as_stored(v_new, v_scale)
            self.ops.prefill_attention(q_chunks, k_new, v_new, meta.cu_seqlens, meta.max_seqlen, self.scale,
                                       out=out_chunks)
        return out


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
        return self.down(self.gate_up_proj(hidden))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest of the MLP from `gate_up_proj`'s output. With the silu_linear fusion, a projection that can take
        the activation into its own launch does (`QuantizedLinear.silu_forward`: one token); with silu_quant, an fp8
        projection's prompt rows get the activation made and quantized in one kernel (`silu_quant_forward`)."""
        fusions = self.ops.fusions
        for fusion, method in (("silu_linear", "silu_forward"), ("silu_quant", "silu_quant_forward")):
            fused = getattr(self.down_proj, method, None) if fusion in fusions else None
            out = fused(gate_up) if fused is not None else None
            if out is not None:
                return out
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, layer_idx: int) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = LlamaAttention(config, ops, layer_idx)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                      kv: KVLayer, slot_mapping: torch.Tensor, cos_sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm (with the residual add), then q, k, v (K/V stored): → (q, k, v, residual)."""
        qkv, residual = self.norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        q, k, v = self.self_attn.project(positions, qkv, kv, slot_mapping, cos_sin)
        return q, k, v, residual

    def norm_linear(self, norm: RMSNorm, linear: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`linear`(norm(hidden + residual)) → (that, hidden + residual); without a residual, of `hidden` alone
        (→ (that, hidden)). With the norm_linear fusion, a projection that can take the norm into its own launch
        does (`QuantizedLinear.add_norm_forward`: one token); with norm_quant, an fp8 projection's prompt rows get
        the norm made and quantized in one kernel (`add_norm_quant_forward`); else the norm kernel, then the
        projection."""
        fusions = self.ops.fusions
        for fusion, method in (("norm_linear", "add_norm_forward"), ("norm_quant", "add_norm_quant_forward")):
            fused = getattr(linear, method, None) if fusion in fusions else None
            result = fused(hidden, residual, norm.weight, norm.eps) if fused is not None else None
            if result is not None:
                return result
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            # The residual add rides along with the norm: one pass over the activations, not two.
            hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return linear(hidden), residual

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, kv: KVLayer,
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer: → (hidden, residual) (the model runs it as pieces: `LlamaForCausalLM.piece`)."""
        q, k, v, residual = self.pre_attention(positions, hidden, residual, kv, meta.slot_mapping, cos_sin)
        out = self.self_attn.attend(q, k, v, kv, meta, torch.empty_like(q))
        return self.post_attention(out.view(out.shape[0], -1), residual)

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection of the attention [T, Hq * D], norm (with the residual add), MLP: → (hidden, residual)."""
        hidden = self.self_attn.o_proj(attn_out)
        gate_up, residual = self.norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
        return self.mlp.down(gate_up), residual


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

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def piece(self, i: int, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              slot_mapping: torch.Tensor, kv_cache: list[KVLayer], cos_sin: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
        """Piece i of N + 1: the work between attention i - 1 and attention i, per token (no mixing across tokens, no
        host reads): what a piecewise CUDA graph captures. Piece 0 embeds `hidden` (the token ids [T]); piece i > 0
        finishes layer i - 1 from its attention output `hidden` [T, Hq * D] and `residual`. Pieces 0..N-1 end with
        layer i's q, k, v (K/V stored) → (q, k, v, residual); piece N with the final norm → (hidden [T, hidden],)."""
        if i == 0:
            hidden, residual = self.model.embed_tokens(hidden), None  # [T, hidden]
        else:
            assert residual is not None
            hidden, residual = self.layer(i - 1).post_attention(hidden, residual)
        if i == self.num_layers:
            assert residual is not None
            norm = self.model.norm
            hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
            return (hidden,)
        return self.layer(i).pre_attention(positions, hidden, residual, kv_cache[i], slot_mapping, cos_sin)

    def layer(self, i: int) -> LlamaDecoderLayer:
        layer = self.model.layers[i]
        assert isinstance(layer, LlamaDecoderLayer)
        return layer

    def attention(self, i: int) -> LlamaAttention:
        attention = self.layer(i).self_attn
        assert isinstance(attention, LlamaAttention)
        return attention

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: list[KVLayer],
               meta: AttentionMetadata, out: torch.Tensor | None = None, with_decode: bool = True) -> torch.Tensor:
        """Layer i's attention of the pieces' q, k, v → [T, Hq * D] (into `out` [T, Hq, D] where given; the decode
        tokens' only `with_decode`)."""
        out = self.attention(i).attend(q, k, v, kv_cache[i], meta, torch.empty_like(q) if out is None else out,
                                       with_decode)
        return out.view(out.shape[0], -1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: list[KVLayer],
                meta: AttentionMetadata, cos_sin: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states of every token, [T, hidden]. `on_layer_done(i)` runs once layer i's K/V
        are in the cache (the prefill role ships them while the next layer computes)."""
        q, k, v, residual = self.piece(0, input_ids, None, positions, meta.slot_mapping, kv_cache, cos_sin)
        for i in range(self.num_layers):
            attn_out = self.attend(i, q, k, v, kv_cache, meta)
            if on_layer_done is not None:
                on_layer_done(i)
            result = self.piece(i + 1, attn_out, residual, positions, meta.slot_mapping, kv_cache, cos_sin)
            if i + 1 < self.num_layers:
                q, k, v, residual = result
        return result[0]

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

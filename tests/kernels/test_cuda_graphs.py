"""The Triton wrappers are CUDA-graph capturable: no host syncs, and a replay sees new input values."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import get_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_decode_layer_ops_capture_and_replay() -> None:
    ops, ref = get_ops("triton"), get_ops("torch")
    device = torch.device("cuda")
    num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 8, 2, 64, 16, 32
    q = torch.randn(num_seqs, num_q_heads, head_dim, device=device)
    k = torch.randn(num_seqs, num_kv_heads, head_dim, device=device)
    v = torch.randn(num_seqs, num_kv_heads, head_dim, device=device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    v_cache = torch.randn_like(k_cache)
    cos_sin = torch.randn(256, head_dim, device=device)
    positions = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    slots = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    block_tables = torch.zeros(num_seqs, 8, dtype=torch.int32, device=device)
    context_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    static_q, static_k = q.clone(), k.clone()

    def step() -> torch.Tensor:
        ops.rotary_embedding(positions, static_q, static_k, cos_sin)
        ops.store_kv(static_k, v, k_cache, v_cache, slots)
        return ops.paged_decode_attention(static_q, k_cache, v_cache, block_tables, context_lens, 0.125,
                                          num_splits=3)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    # New values into the static inputs, as the runner does before each replay; one row is padding.
    new_positions, new_lens = [5, 100, 0, 17], [6, 101, 0, 18]
    new_tables = torch.randperm(num_blocks)[: num_seqs * 8].view(num_seqs, 8).int()
    positions.copy_(torch.tensor(new_positions))
    context_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    block_tables.copy_(new_tables)
    slots.copy_(torch.tensor([int(new_tables[s, p // block_size]) * block_size + p % block_size if n else -1
                              for s, (p, n) in enumerate(zip(new_positions, new_lens, strict=True))]))
    static_q.copy_(q)
    static_k.copy_(k)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    graph.replay()

    ref_q, ref_k = ref.rotary_embedding(positions, q.clone(), k.clone(), cos_sin)
    ref.store_kv(ref_k, v, expected_k_cache, expected_v_cache, slots)
    expected = ref.paged_decode_attention(ref_q, expected_k_cache, expected_v_cache, block_tables, context_lens,
                                          0.125)
    torch.testing.assert_close(k_cache, expected_k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert bool((out[2] == 0).all())


def test_prefill_ops_capture() -> None:
    ops, ref = get_ops("triton"), get_ops("torch")
    device = torch.device("cuda")
    hidden = torch.randn(37, 96, device=device)
    residual = torch.randn(37, 96, device=device)
    weight = torch.randn(96, device=device)
    gate_up = torch.randn(37, 2 * 80, device=device)
    q, k, v = (torch.randn(37, h, 32, device=device) for h in (6, 2, 2))
    cu_seqlens = torch.tensor([0, 30, 37], dtype=torch.int32, device=device)
    static_hidden, static_residual = hidden.clone(), residual.clone()

    def step() -> tuple[torch.Tensor, ...]:
        normed = ops.rms_norm(static_hidden, weight, 1e-5)
        added, new_residual = ops.fused_add_rms_norm(normed.clone(), static_residual, weight, 1e-5)
        return normed, added, new_residual, ops.silu_and_mul(gate_up), ops.prefill_attention(
            q, k, v, cu_seqlens, 30, 0.2)

    step()
    static_residual.copy_(residual)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    static_residual.copy_(residual)
    graph.replay()
    normed = ref.rms_norm(hidden, weight, 1e-5)
    expected = (normed, *ref.fused_add_rms_norm(normed, residual, weight, 1e-5), ref.silu_and_mul(gate_up),
                ref.prefill_attention(q, k, v, cu_seqlens, 30, 0.2))
    for got, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

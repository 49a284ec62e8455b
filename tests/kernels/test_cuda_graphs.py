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


def test_rope_store_kv_captures_like_the_unfused_pair() -> None:
    """The fused RoPE + KV store under capture: each replay rotates the new q/k and stores k/v at the new slots,
    bit for bit what rotary_embedding then store_kv write."""
    fused, unfused = get_ops("triton", "all"), get_ops("triton", "none")
    device = torch.device("cuda")
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 8, 2, 64, 16, 32
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    static_qkv = qkv.clone()
    q, k, v = static_qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    cos_sin = torch.randn(256, head_dim, device=device)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)

    fused.rope_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.rope_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    for step in range(3):
        positions.copy_(torch.randint(0, 256, (num_tokens,)))
        slots.copy_(torch.randperm(num_blocks * block_size)[:num_tokens])
        slots[step] = -1  # a padding token
        static_qkv.copy_(qkv + step)
        expected_qkv = static_qkv.clone()
        expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
        eq, ek, ev = expected_qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
        unfused.rope_store_kv(positions, eq.view(q.shape), ek.view(k.shape), ev.view(v.shape), cos_sin,
                              expected_k_cache, expected_v_cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_qkv, expected_qkv)
        assert torch.equal(k_cache, expected_k_cache) and torch.equal(v_cache, expected_v_cache)


def test_combine_in_kernel_replays_like_the_combine_launch() -> None:
    """The split kernel that merges its own splits (attn_combine), at a Llama-8B group shape with many splits,
    captured and replayed many times: every replay equals the two-launch result (a split read before its writer
    finished, or a counter left armed, would show as a difference far above bf16's rounding)."""
    from tandem.kernels.paged_decode_attention import paged_decode_attention_triton

    device, dtype = torch.device("cuda"), torch.bfloat16
    num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_splits = 2, 32, 8, 128, 16, 32
    blocks_per_seq = 2048 // block_size
    k_cache = torch.randn(num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1).int()
    context_lens = torch.tensor([2048, 1000], dtype=torch.int32, device=device)
    q = torch.randn(num_seqs, num_q_heads, head_dim, device=device, dtype=dtype)

    def attend(combine_in_kernel: bool) -> torch.Tensor:
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, head_dim ** -0.5,
                                             num_splits=num_splits, combine_in_kernel=combine_in_kernel)

    attend(True)  # compile, and the arrival counters, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(True)
    for step in range(200):
        q.copy_(torch.randn_like(q))
        if step % 50 == 0:
            context_lens.copy_(torch.randint(0, 2049, (num_seqs,), dtype=torch.int32))
        expected = attend(False)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2, msg=lambda m, s=step: f"replay {s}: {m}")


def test_piecewise_graphs_give_the_eager_tokens() -> None:
    """Steps with prompt tokens (chunks beside decode tokens, later chunks over context) through captured pieces give
    the tokens of the eager forward, in float32."""
    from tandem import LLM, SamplingParams
    from tests.factories import prompts_for

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = prompts_for(256, [70, 3, 45, 17, 33, 100, 260])
    outputs = {}
    for piecewise in (False, True):
        llm = LLM("dummy:tiny", device="cuda", dtype="float32", max_model_len=512, max_num_batched_tokens=64,
                  max_num_seqs=8, block_size=16, piecewise_cuda_graphs=piecewise, num_kv_blocks=256)
        runner = llm.engine.runner
        assert (runner.mixed_graphs is not None) == piecewise
        if piecewise:
            assert runner.mixed_graphs is not None and runner.mixed_graphs.buckets[-1] == 64
            # Every bucket was timed at start-up; each size replays a bucket at least as large.
            route = runner.mixed_graphs.bucket
            assert set(route.times_ms) == set(route.buckets) and all(t > 0 for t in route.times_ms.values())
            assert all(to >= size for size, to in route.route.items())
        outputs[piecewise] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]

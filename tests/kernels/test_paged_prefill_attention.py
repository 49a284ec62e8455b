"""paged_prefill_attention: the reference vs dense causal attention over the whole sequences; the kernel vs
the reference over irregular (context, new tokens) batches, scattered pages, every output element written;
fp8 caches: kernel vs reference over the same pages, the reference vs attention over the unquantized K/V."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels.fp8_kv import dequantize_kv, kv_scales_from_absmax, quantize_kv
from tandem.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton
from tandem.kernels.prefill_attention import prefill_attention_ref
from tandem.kernels.store_kv import store_kv_ref

# (Hq, Hkv, D): a non-power-of-two GQA group, plain MHA, a group of 4 with a ragged head_dim, MQA with D 80.
HEADS = [(9, 3, 64), (4, 4, 32), (8, 2, 48), (8, 1, 80)]
# (block_size, [(context, new tokens) per sequence]).
CASES = [
    (16, [(0, 37)]),  # plain prefill: chunk not a multiple of the block size
    (16, [(40, 1), (0, 1), (15, 1), (16, 1)]),  # decode steps, contexts ending mid-block and on its edge
    (8, [(21, 13), (32, 16), (5, 3)]),  # prefix-cache suffixes and chunks, contexts ending mid-block
    (16, [(0, 5), (70, 1), (17, 29), (3, 4), (48, 16)]),  # a mixed batch: prefill, decode, chunk, spec
    (64, [(9, 70), (100, 2)]),  # pages larger than a key tile; several query blocks
]


def _paged(contexts: list[int], q_lens: list[int], block_size: int, num_q_heads: int, num_kv_heads: int,
           head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q [T, Hq, D] and caches with each sequence's blocks scattered over a shuffled pool; the table
    entries past a sequence's blocks hold garbage, as a reused or wider (graph) table would."""
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 2
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    pool = torch.randperm(num_blocks).tolist()
    block_tables = torch.randint(-1000, 1 << 20, (len(seq_lens), max_blocks), dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables.to(device), cu_seqlens_q, lens


def _poison_new_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the op's output start as NaN, so an element the kernel never writes fails the comparison."""
    new_empty = torch.Tensor.new_empty

    def poisoned(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = new_empty(self, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("block_size", [16, 8])
def test_ref_matches_dense_prefill(heads: tuple[int, int, int], block_size: int) -> None:
    """Whole sequences through dense causal attention; their K/V written to scattered pages by store_kv,
    their last q_len queries through the paged reference: the same rows must come out."""
    num_q_heads, num_kv_heads, head_dim = heads
    contexts, q_lens = [0, 13, 31, 4], [9, 1, 6, 12]
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    _, k_cache, v_cache, block_tables, cu_seqlens_q, lens = _paged(
        contexts, q_lens, block_size, *heads, torch.float32, torch.device("cpu"))
    num_tokens = sum(seq_lens)
    q_full = torch.randn(num_tokens, num_q_heads, head_dim)
    k_full = torch.randn(num_tokens, num_kv_heads, head_dim)
    v_full = torch.randn(num_tokens, num_kv_heads, head_dim)
    slots, new_rows, start = [], [], 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        slots += [int(block_tables[s, i // block_size]) * block_size + i % block_size for i in range(seq_len)]
        new_rows += range(start + seq_len - q_len, start + seq_len)
        start += seq_len
    store_kv_ref(k_full, v_full, k_cache, v_cache, torch.tensor(slots))
    cu_full = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    expected = prefill_attention_ref(q_full, k_full, v_full, cu_full, max(seq_lens), scale)[new_rows]
    out = paged_prefill_attention_ref(q_full[new_rows], k_cache, v_cache, block_tables, cu_seqlens_q, lens,
                                      max(q_lens), scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize(("block_size", "seqs"), CASES, ids=str)
def test_kernel_matches_ref(heads: tuple[int, int, int], block_size: int, seqs: list[tuple[int, int]],
                            dtype: torch.dtype, device: torch.device, tol: dict[str, float],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    contexts, q_lens = (list(x) for x in zip(*seqs, strict=True))
    inputs = _paged(contexts, q_lens, block_size, *heads, dtype, device)
    scale = heads[2] ** -0.5
    expected = paged_prefill_attention_ref(*inputs, max(q_lens), scale)
    _poison_new_empty(monkeypatch)
    out = paged_prefill_attention_triton(*inputs, max(q_lens), scale)
    assert out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_random_batches(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random mixes of contexts and chunk lengths, with a max_seqlen_q above the longest chunk (as a
    CUDA graph captured for a bound would pass)."""
    rng = random.Random(0)
    _poison_new_empty(monkeypatch)
    for _ in range(6):
        num_seqs = rng.randint(1, 5)
        contexts = [rng.choice([0, rng.randint(1, 80)]) for _ in range(num_seqs)]
        q_lens = [rng.choice([1, rng.randint(1, 4), rng.randint(1, 50)]) for _ in range(num_seqs)]
        block_size = rng.choice([4, 8, 16, 32])
        heads = rng.choice(HEADS)
        inputs = _paged(contexts, q_lens, block_size, *heads, torch.float32, device)
        expected = paged_prefill_attention_ref(*inputs, max(q_lens), 0.125)
        out = paged_prefill_attention_triton(*inputs, max(q_lens) + 7, 0.125)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, c=contexts, n=q_lens, b=block_size, h=heads:
                                   f"contexts {c}, q_lens {n}, block_size {b}, heads {h}: {m}")


@pytest.mark.usefixtures("needs_triton")
def test_kernel_strided_q_layer_view_and_empty_sequences(device: torch.device) -> None:
    # q a view of a merged qkv output; caches one layer's views of [L, 2, N, B, Hkv, D]; sequences with no
    # new tokens (CUDA-graph padding) in the batch.
    num_q_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    contexts, q_lens = [0, 11, 0, 30], [0, 9, 0, 3]
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    num_tokens = sum(q_lens)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    kv = torch.randn(2, 2, 9, block_size, num_kv_heads, head_dim, device=device)
    block_tables = torch.tensor([[0] * 5, [5, 1, 6, 0, 0], [0] * 5, [2, 8, 4, 7, 3]], dtype=torch.int32,
                                device=device)
    cu_seqlens_q = torch.tensor([0, 0, 9, 9, 12], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, kv[1, 0], kv[1, 1], block_tables, cu_seqlens_q, lens, max(q_lens), 0.25)
    out = paged_prefill_attention_triton(*args)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_bad_arguments_name_the_argument(op: str, device: torch.device, request: pytest.FixtureRequest) -> None:
    if op == "triton":
        request.getfixturevalue("needs_triton")
    fn = paged_prefill_attention_ref if op == "ref" else paged_prefill_attention_triton
    q, k_cache, v_cache, block_tables, cu, lens = _paged([3, 0], [2, 4], 8, 4, 2, 16, torch.float32, device)
    good = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "cu_seqlens_q": cu,
            "seq_lens": lens}
    bad = [
        ("q", q[0], r"q must be \[T, Hq, D\]"),
        ("q", q[:, :3], "query heads not a multiple"),
        ("k_cache", k_cache[0], "k_cache"),
        ("k_cache", k_cache[..., :8], "k_cache"),
        ("v_cache", v_cache[:, :4], "v_cache"),
        ("v_cache", v_cache.double(), "dtype"),
        ("block_tables", block_tables[:1], "block_tables"),
        ("block_tables", block_tables.float(), "block_tables"),
        ("cu_seqlens_q", cu[None], "cu_seqlens_q"),
        ("seq_lens", lens[:1], "seq_lens"),
    ]
    if op == "triton":  # the kernel needs a unit last stride; the reference does not care
        bad.append(("q", q.transpose(1, 2).contiguous().transpose(1, 2), "q must be contiguous"))
        bad.append(("k_cache", k_cache.transpose(2, 3).contiguous().transpose(2, 3), "k_cache must be contiguous"))
    for name, value, message in bad:
        with pytest.raises(ValueError, match=message):
            fn(**{**good, name: value}, max_seqlen_q=4, scale=0.25)


def _fp8(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The caches quantized to e4m3 with per-head scales calibrated on them: (k8, v8, k_scale, v_scale)."""
    absmax = torch.stack([k_cache.abs().amax(dim=(0, 1, 3)), v_cache.abs().amax(dim=(0, 1, 3))])
    k_scale, v_scale = kv_scales_from_absmax(absmax.float())
    return quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale), k_scale, v_scale


def test_ref_fp8_against_unquantized() -> None:
    contexts, q_lens = [0, 70, 17, 3], [5, 1, 29, 4]
    q, k_cache, v_cache, block_tables, cu, lens = _paged(contexts, q_lens, 16, 9, 3, 48, torch.float32,
                                                         torch.device("cpu"))
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    args = (block_tables, cu, lens, max(q_lens), 48**-0.5)
    out = paged_prefill_attention_ref(q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale)
    dequantized = (dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale))
    torch.testing.assert_close(out, paged_prefill_attention_ref(q, *dequantized, *args), atol=1e-6, rtol=1e-6)
    # e4m3's rounding of K and V, through unit-spread logits: ~3.4% of the output's norm expected, 2^-4 at
    # most (the bound and its reasoning as in test_paged_decode_attention). The first query of sequence 0
    # sees only its own key, so its output is its V row rounded: within 2^-4 per element.
    exact = paged_prefill_attention_ref(q, k_cache, v_cache, *args)
    assert float((out - exact).norm() / exact.norm()) < 2.0**-4
    v0 = v_cache[block_tables[0, 0].long(), 0].repeat_interleave(3, dim=0)  # [Hq, D]
    bound = 2.0**-4 * v0.abs() + 2.0**-10 * v_scale.repeat_interleave(3)[:, None]
    assert bool(((out[0] - v0).abs() <= bound).all())


@pytest.mark.usefixtures("needs_triton")
def test_kernel_fp8_matches_ref(dtype: torch.dtype, device: torch.device, tol: dict[str, float],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A mixed batch (prefill, decode, chunk on a context ending mid-block, spec), a group of 3, ragged D.
    contexts, q_lens = [0, 70, 17, 3], [5, 1, 29, 4]
    q, k_cache, v_cache, block_tables, cu, lens = _paged(contexts, q_lens, 16, 9, 3, 48, torch.float32, device)
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    args = (q.to(dtype), k8, v8, block_tables, cu, lens, max(q_lens), 48**-0.5)
    expected = paged_prefill_attention_ref(*args, k_scale=k_scale, v_scale=v_scale)
    _poison_new_empty(monkeypatch)
    out = paged_prefill_attention_triton(*args, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_fp8_scales_checked(op: str, device: torch.device, request: pytest.FixtureRequest) -> None:
    if op == "triton":
        request.getfixturevalue("needs_triton")
    fn = paged_prefill_attention_ref if op == "ref" else paged_prefill_attention_triton
    q, k_cache, v_cache, block_tables, cu, lens = _paged([3, 0], [2, 4], 8, 4, 2, 16, torch.float32, device)
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    args = (block_tables, cu, lens, 4, 0.25)
    with pytest.raises(ValueError, match="needs v_scale"):
        fn(q, k8, v8, *args, k_scale=k_scale)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        fn(q, k8, v8, *args, k_scale=k_scale.double(), v_scale=v_scale)
    with pytest.raises(ValueError, match="v_scale is only for"):
        fn(q, k_cache, v_cache, *args, v_scale=v_scale)

"""paged_decode_attention: kernel vs reference over shuffled pages, splits, padding rows; the
reference vs contiguous attention over each sequence's gathered context; fp8 caches: kernel vs reference
over the same fp8 pages, and the fp8 reference vs attention over the unquantized K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tandem.kernels.fp8_kv import dequantize_kv, kv_scales_from_absmax, quantize_kv
from tandem.kernels.paged_decode_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    DecodeAttentionConfig,
    choose_num_splits,
    decode_attention_config,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

HEADS = [(9, 3, 64), (4, 4, 32), (8, 2, 48)]
# e4m3 rounds each element to within 2^-4 of itself, ~2.4% RMS for evenly spread mantissas. With unit-spread
# logits (randn q, k, scale D^-0.5) the output carries one such error from V and one from K through the
# softmax, adding in quadrature: ~3.4% of its norm expected (2.5-3.3% seen), bounded here by 2^-4.
FP8_REL_RMS_BOUND = 2.0**-4


def _paged(context_lens: list[int], block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
           dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random caches with each sequence's blocks scattered over a shuffled pool; unused table entries -1."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1  # one spare column, as a wider graph table would have
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    pool = torch.randperm(num_blocks).tolist()
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    q = torch.randn(len(context_lens), num_q_heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables.to(device), lens


def _fp8(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The caches quantized to e4m3 with per-head scales calibrated on them: (k8, v8, k_scale, v_scale)."""
    absmax = torch.stack([k_cache.abs().amax(dim=(0, 1, 3)), v_cache.abs().amax(dim=(0, 1, 3))])
    k_scale, v_scale = kv_scales_from_absmax(absmax.float())
    return quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale), k_scale, v_scale


def _contiguous(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence at a time: gather its pages into a contiguous [L, Hkv, D] context, then SDPA."""
    out = torch.zeros_like(q)
    block_size = k_cache.shape[1]
    for s, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        pages = block_tables[s, : -(-n // block_size)].long()
        k = k_cache[pages].flatten(0, 1)[:n].transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[pages].flatten(0, 1)[:n].transpose(0, 1)
        out[s] = F.scaled_dot_product_attention(q[s][:, None], k, v, scale=scale, enable_gqa=True)[:, 0]
    return out


@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("block_size", [16, 8])
def test_ref_matches_contiguous(heads: tuple[int, int, int], block_size: int) -> None:
    inputs = _paged([37, 1, 0, 16, 50], block_size, *heads, torch.float32, torch.device("cpu"))
    scale = heads[2] ** -0.5
    torch.testing.assert_close(paged_decode_attention_ref(*inputs, scale), _contiguous(*inputs, scale),
                               atol=1e-5, rtol=1e-5)


def test_ref_all_padding_is_zero() -> None:
    inputs = _paged([0, 0], 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    assert bool((paged_decode_attention_ref(*inputs, 0.25) == 0).all())


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize(("context_lens", "block_size"), [([37], 16), ([1, 17, 40, 0, 23], 8), ([90, 5], 16)],
                         ids=str)
def test_kernel_matches_ref(heads: tuple[int, int, int], context_lens: list[int], block_size: int,
                            dtype: torch.dtype, device: torch.device, tol: dict[str, float]) -> None:
    inputs = _paged(context_lens, block_size, *heads, dtype, device)
    scale = heads[2] ** -0.5
    expected = paged_decode_attention_ref(*inputs, scale)
    for num_splits in (1, 3, None):  # one pass, a combine over splits (some empty), the heuristic
        out = paged_decode_attention_triton(*inputs, scale, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **tol, msg=lambda m, n=num_splits: f"num_splits={n}: {m}")


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_kernel_padding_rows_are_zero(num_splits: int, device: torch.device) -> None:
    inputs = _paged([0, 12, 0], 8, 4, 2, 32, torch.float32, device)
    out = paged_decode_attention_triton(*inputs, 0.2, num_splits=num_splits)
    assert not bool(out.isnan().any())
    assert bool((out[0] == 0).all()) and bool((out[2] == 0).all())
    torch.testing.assert_close(out[1], paged_decode_attention_ref(*inputs, 0.2)[1], atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_rejects_unsupported(device: torch.device) -> None:
    q, k_cache, v_cache, block_tables, lens = _paged([3], 8, 4, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention_triton(q, k_cache, v_cache, block_tables, lens, 0.25, num_splits=0)
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention_triton(q[:, :3], k_cache, v_cache, block_tables, lens, 0.25)


@given(num_seqs=st.integers(1, 512), num_kv_heads=st.integers(1, 16), max_context=st.integers(0, 1 << 17),
       num_sms=st.integers(1, 160))
def test_choose_num_splits_bounds(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> None:
    splits = choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms)
    assert 1 <= splits <= MAX_SPLITS
    # Never so many that a split streams fewer than MIN_TOKENS_PER_SPLIT tokens (beyond the first).
    assert splits == 1 or splits * MIN_TOKENS_PER_SPLIT <= max_context
    if num_seqs * num_kv_heads >= 2 * num_sms:  # the grid already fills the GPU
        assert splits == 1


def test_choose_num_splits_examples() -> None:
    # H200 (132 SMs), Llama-3.1-8B (8 kv heads): batch 1 at 16k context splits, batch 64 does not.
    assert choose_num_splits(1, 8, 16384, 132) == MAX_SPLITS
    assert choose_num_splits(1, 8, 1024, 132) == 1024 // MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(64, 8, 1024, 132) == 1


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 48)], ids=str)
def test_ref_fp8_against_unquantized(heads: tuple[int, int, int]) -> None:
    q, k_cache, v_cache, block_tables, lens = _paged([1, 17, 40, 0, 300], 8, *heads, torch.float32,
                                                     torch.device("cpu"))
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    scale = heads[2] ** -0.5
    out = paged_decode_attention_ref(q, k8, v8, block_tables, lens, scale, k_scale=k_scale, v_scale=v_scale)
    # Exactly attention over the dequantized pages...
    dequantized = (dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale))
    torch.testing.assert_close(out, paged_decode_attention_ref(q, *dequantized, block_tables, lens, scale),
                               atol=1e-6, rtol=1e-6)
    # ...within e4m3's rounding of attention over the unquantized ones...
    exact = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale)
    assert float((out - exact).norm() / exact.norm()) < FP8_REL_RMS_BOUND
    # ...and a context of one token returns its V row: exactly V's rounding, 2^-4 of each element at most.
    v0 = v_cache[block_tables[0, 0].long(), 0]  # [Hkv, D]
    bound = 2.0**-4 * v0.abs() + 2.0**-10 * v_scale[:, None]  # normals, and half a subnormal step
    assert bool(((out[0] - v0.repeat_interleave(heads[0] // heads[1], dim=0)).abs()
                 <= bound.repeat_interleave(heads[0] // heads[1], dim=0)).all())
    assert bool((out[3] == 0).all())


@pytest.mark.usefixtures("needs_triton")
def test_kernel_fp8_matches_ref(dtype: torch.dtype, device: torch.device, tol: dict[str, float]) -> None:
    heads = (9, 3, 48)  # a group of 3 and a ragged head_dim
    q, k_cache, v_cache, block_tables, lens = _paged([1, 17, 40, 0, 23], 8, *heads, torch.float32, device)
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    args = (q.to(dtype), k8, v8, block_tables, lens, heads[2] ** -0.5)
    expected = paged_decode_attention_ref(*args, k_scale=k_scale, v_scale=v_scale)
    for num_splits in (1, 3):  # the scales in the one-pass epilogue, and through the combine
        out = paged_decode_attention_triton(*args, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
        torch.testing.assert_close(out, expected, **tol, msg=lambda m, n=num_splits: f"num_splits={n}: {m}")


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("config", [DecodeAttentionConfig(64, 4, 2, True), DecodeAttentionConfig(128, 8, 3, True),
                                    DecodeAttentionConfig(32, 4, 2, True)], ids=str)
def test_kernel_fp8_f16_dot(config: DecodeAttentionConfig, device: torch.device) -> None:
    """An fp8 cache read by a bf16 q with fp16 dots (and other tiles): the reference's output within bf16's
    rounding of it, through one pass and through splits; contexts past one tile and ragged ones, and a head whose q
    is past fp16's range."""
    heads = (8, 2, 64)
    q, k_cache, v_cache, block_tables, lens = _paged([1, 17, 40, 0, 23, 130], 16, *heads, torch.float32, device)
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    q[1, 0] *= 1e5  # entries past fp16's 65504: the kernel scales q into range (a plain cast would give inf, NaN out)
    args = (q.to(torch.bfloat16), k8, v8, block_tables, lens, heads[2] ** -0.5)
    expected = paged_decode_attention_ref(*args, k_scale=k_scale, v_scale=v_scale)
    for num_splits in (1, 3):
        out = paged_decode_attention_triton(*args, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
                                            config=config)
        assert bool(out.isfinite().all())
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2,
                                   msg=lambda m, n=num_splits: f"num_splits={n}: {m}")


@pytest.mark.usefixtures("needs_triton")
def test_kernel_fp8_large_q(dtype: torch.dtype, device: torch.device, tol: dict[str, float]) -> None:
    """The default tiles (no fp16 dots) with a query head near 1e5, as `test_kernel_fp8_f16_dot` has: finite and the
    reference's, so that a GPU run tells a failure of the fp16 path from one of the kernel's (an H100 gave non-finite
    output for the fp16 path with a fixed 2^-8 scaling of q, 2026-12-07)."""
    heads = (8, 2, 64)
    q, k_cache, v_cache, block_tables, lens = _paged([1, 17, 40, 0, 23, 130], 16, *heads, torch.float32, device)
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    q[1, 0] *= 1e5
    args = (q.to(dtype), k8, v8, block_tables, lens, heads[2] ** -0.5)
    expected = paged_decode_attention_ref(*args, k_scale=k_scale, v_scale=v_scale)
    for num_splits in (1, 3):
        out = paged_decode_attention_triton(*args, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
        assert bool(out.isfinite().all()), num_splits
        torch.testing.assert_close(out, expected, **tol, msg=lambda m, n=num_splits: f"num_splits={n}: {m}")


def test_fp8_tile_by_split_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 cache's tile doubles its tokens and multiplies in fp16 where no splits run (the H100's sweep and step),
    keeps the bf16 tile with splits and at D 64; bf16 caches are unchanged; the environment's tile overrides an fp8
    cache's only."""
    from tandem.kernels import paged_decode_attention as module

    assert decode_attention_config(128, True, 1) == DecodeAttentionConfig(128, 4, 3, True)
    assert decode_attention_config(256, True, 1) == DecodeAttentionConfig(64, 4, 2)
    assert decode_attention_config(128, True, 16) == DecodeAttentionConfig(64, 4, 2)
    assert decode_attention_config(128, False, 1) == DecodeAttentionConfig(64, 4, 2)
    assert decode_attention_config(64, True, 1) == DecodeAttentionConfig(128, 4, 2)
    monkeypatch.setenv(module.FP8_TILE_ENV, "128,4,3,f16")
    module._fp8_tile_override.cache_clear()
    try:
        assert decode_attention_config(128, True, 16) == DecodeAttentionConfig(128, 4, 3, True)
        assert decode_attention_config(128, False, 1) == DecodeAttentionConfig(64, 4, 2)
        monkeypatch.setenv(module.FP8_TILE_ENV, "128,4,2,bf16")
        module._fp8_tile_override.cache_clear()
        assert decode_attention_config(128, True, 1) == DecodeAttentionConfig(128, 4, 2)
    finally:
        monkeypatch.delenv(module.FP8_TILE_ENV)
        module._fp8_tile_override.cache_clear()


def test_fp8_tile_setting_parsed() -> None:
    assert DecodeAttentionConfig.parse("128, 8, 3, f16") == DecodeAttentionConfig(128, 8, 3, True)
    assert DecodeAttentionConfig.parse("64,4,2") == DecodeAttentionConfig(64, 4, 2, False)
    for bad in ("64,4", "64,4,2,fp32", "48,4,2", "64,3,2", "64,4,0", "a,b,c"):
        with pytest.raises(ValueError, match="TANDEM_FP8_KV_DECODE_TILE"):
            DecodeAttentionConfig.parse(bad)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_fp8_scales_checked(op: str, device: torch.device, request: pytest.FixtureRequest) -> None:
    if op == "triton":
        request.getfixturevalue("needs_triton")
    fn = paged_decode_attention_ref if op == "ref" else paged_decode_attention_triton
    q, k_cache, v_cache, block_tables, lens = _paged([3], 8, 4, 2, 16, torch.float32, device)
    k8, v8, k_scale, v_scale = _fp8(k_cache, v_cache)
    with pytest.raises(ValueError, match="needs k_scale"):
        fn(q, k8, v8, block_tables, lens, 0.25)
    with pytest.raises(ValueError, match="v_scale must be float32"):
        fn(q, k8, v8, block_tables, lens, 0.25, k_scale=k_scale, v_scale=v_scale[:1])
    with pytest.raises(ValueError, match="k_scale is only for"):
        fn(q, k_cache, v_cache, block_tables, lens, 0.25, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("is_fp8", [False, True], ids=["same_dtype", "fp8"])
@pytest.mark.parametrize("heads", [(4, 2, 32), (9, 3, 48)], ids=str)
def test_combine_in_kernel_equals_the_combine_launch(heads: tuple[int, int, int], is_fp8: bool,
                                                     device: torch.device) -> None:
    """The last split of each (sequence, kv head) merging in the split kernel: the combine kernel's output bit for
    bit (the same code), padding rows and empty splits included, and its arrival counters left at zero for the
    next launch (what a CUDA graph's replay relies on)."""
    from tandem.kernels import paged_decode_attention as module

    q, k_cache, v_cache, block_tables, lens = _paged([1, 17, 40, 0, 23], 8, *heads, torch.float32, device)
    scales: dict[str, torch.Tensor] = {}
    if is_fp8:
        k_cache, v_cache, k_scale, v_scale = _fp8(k_cache, v_cache)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    args = (q, k_cache, v_cache, block_tables, lens, heads[2] ** -0.5)
    for num_splits in (1, 3, 8):  # one pass (nothing to merge), splits, splits mostly empty
        two_launches = paged_decode_attention_triton(*args, num_splits=num_splits, **scales)
        for _ in range(2):  # the second launch reuses the rearmed counters
            one_launch = paged_decode_attention_triton(*args, num_splits=num_splits, combine_in_kernel=True,
                                                       **scales)
            assert torch.equal(one_launch, two_launches), num_splits
        if num_splits > 1:
            counters = module._COUNTERS.get(q.device)
            assert counters is not None and not bool(counters.any())

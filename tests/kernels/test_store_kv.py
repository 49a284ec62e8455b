"""store_kv: kernel vs reference vs a per-token loop; slot -1 skipped, other slots untouched; fp8 caches
bit for bit."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_kv import FP8_KV_DTYPE, quantize_kv
from tandem.kernels.store_kv import store_kv_ref, store_kv_triton

SENTINEL = 7.0


def _inputs(num_tokens: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, SENTINEL, dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, SENTINEL, dtype=dtype, device=device)
    # Distinct random slots anywhere in the cache, with some tokens marked as padding (-1).
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.25] = -1
    return k, v, k_cache, v_cache, slots


def test_ref_matches_loop() -> None:
    k, v, k_cache, v_cache, slots = _inputs(13, 5, 8, 3, 16, torch.float32, torch.device("cpu"))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 8, slot % 8] = k[t]
            expected_v[slot // 8, slot % 8] = v[t]
    store_kv_ref(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("num_tokens", "block_size", "num_kv_heads", "head_dim"),
                         [(1, 16, 4, 32), (7, 8, 3, 64), (37, 16, 2, 48)])
def test_kernel_matches_ref(num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype, device: torch.device) -> None:
    k, v, k_cache, v_cache, slots = _inputs(num_tokens, 6, block_size, num_kv_heads, head_dim, dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    # A copy: exact, and every slot not written (padding included) still holds the sentinel.
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_all_padding_writes_nothing(device: torch.device) -> None:
    k, v, k_cache, v_cache, _ = _inputs(4, 2, 8, 2, 16, torch.float32, device)
    store_kv_triton(k, v, k_cache, v_cache, torch.full((4,), -1, dtype=torch.int64, device=device))
    assert bool((k_cache == SENTINEL).all()) and bool((v_cache == SENTINEL).all())


@pytest.mark.usefixtures("needs_triton")
def test_kernel_strided_sources_and_layer_view(device: torch.device) -> None:
    # k, v as views of a fused qkv output; caches as one layer's views of [L, 2, N, B, Hkv, D].
    qkv = torch.randn(5, (4 + 2 + 2) * 16, device=device)
    k, v = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    kv = torch.zeros(2, 2, 3, 8, 2, 16, device=device)
    slots = torch.tensor([3, 17, -1, 0, 23], device=device)
    expected = kv.clone()
    store_kv_ref(k, v, expected[1, 0], expected[1, 1], slots)
    store_kv_triton(k, v, kv[1, 0], kv[1, 1], slots)
    torch.testing.assert_close(kv, expected, atol=0, rtol=0)


def _fp8_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 caches filled with a sentinel code (0x7E = 416), so a stray write shows."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 0x7E, dtype=torch.uint8, device=device).view(FP8_KV_DTYPE)
    return k_cache, k_cache.clone()


def test_ref_fp8_matches_quantize_loop() -> None:
    k, v, _, _, slots = _inputs(13, 5, 8, 3, 24, torch.float32, torch.device("cpu"))
    k_cache, v_cache = _fp8_caches(5, 8, 3, 24, torch.device("cpu"))
    k_scale, v_scale = torch.tensor([0.5, 1.0, 0.01]), torch.tensor([2.0, 0.003, 1.0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 8, slot % 8] = quantize_kv(k[t], k_scale)
            expected_v[slot // 8, slot % 8] = quantize_kv(v[t], v_scale)
    store_kv_ref(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("num_tokens", "block_size", "num_kv_heads", "head_dim"), [(7, 8, 3, 48), (19, 16, 2, 80)])
def test_kernel_fp8_bit_exact(num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int,
                              dtype: torch.dtype, device: torch.device) -> None:
    # Values spanning e4m3's subnormals, normals and past the clamp (|x / scale| up to ~4000).
    k, v, _, _, slots = _inputs(num_tokens, 6, block_size, num_kv_heads, head_dim, dtype, device)
    k, v = k * torch.logspace(-4, 3, head_dim, device=device).to(dtype), v * 100
    k_cache, v_cache = _fp8_caches(6, block_size, num_kv_heads, head_dim, device)
    k_scale = torch.rand(num_kv_heads, device=device) + 0.05
    v_scale = torch.rand(num_kv_heads, device=device) + 0.05
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots, k_scale=k_scale, v_scale=v_scale)
    store_kv_triton(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    # Same codes bit for bit (integer rounding in the kernel), and the sentinel wherever nothing was stored.
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.usefixtures("needs_triton")
def test_kernel_fp8_strided_sources_and_layer_view(device: torch.device) -> None:
    qkv = torch.randn(5, (4 + 2 + 2) * 16, device=device)
    k, v = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    kv = torch.zeros(2, 2, 3, 8, 2, 16, device=device).to(FP8_KV_DTYPE)
    scales = torch.tensor([[0.25, 0.02], [0.01, 1.0]], device=device)  # one layer's [2, Hkv]
    slots = torch.tensor([3, 17, -1, 0, 23], device=device)
    expected = kv.clone()
    store_kv_ref(k, v, expected[1, 0], expected[1, 1], slots, k_scale=scales[0], v_scale=scales[1])
    store_kv_triton(k, v, kv[1, 0], kv[1, 1], slots, k_scale=scales[0], v_scale=scales[1])
    assert torch.equal(kv.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_scales_checked(op: str, device: torch.device, request: pytest.FixtureRequest) -> None:
    if op == "triton":
        request.getfixturevalue("needs_triton")
    fn = store_kv_ref if op == "ref" else store_kv_triton
    k, v, k_cache, v_cache, slots = _inputs(3, 2, 8, 2, 16, torch.float32, device)
    fp8_k, fp8_v = _fp8_caches(2, 8, 2, 16, device)
    ones = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="needs k_scale"):
        fn(k, v, fp8_k, fp8_v, slots)
    with pytest.raises(ValueError, match="v_scale must be float32"):
        fn(k, v, fp8_k, fp8_v, slots, k_scale=ones, v_scale=ones[:1])
    with pytest.raises(ValueError, match="k_scale is only for"):
        fn(k, v, k_cache, v_cache, slots, k_scale=ones, v_scale=ones)

"""paged_decode_attention: kernel vs reference over shuffled pages, splits, padding rows; the
reference vs contiguous attention over each sequence's gathered context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tandem.kernels.paged_decode_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

HEADS = [(9, 3, 64), (4, 4, 32), (8, 2, 48)]


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

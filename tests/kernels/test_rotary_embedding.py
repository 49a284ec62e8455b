"""rotary_embedding: kernel vs reference (in place, strided views), reference vs HF's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tandem.common.config import RopeConfig
from tandem.engine.rope import cos_sin_cache
from tandem.kernels.rotary_embedding import rotary_embedding_ref, rotary_embedding_triton

LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64)


def _qkv_views(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k as the model makes them: strided views of one fused qkv projection output."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)


def test_ref_matches_hf() -> None:
    num_tokens, head_dim = 11, 64
    cache = cos_sin_cache(LLAMA3_ROPE, head_dim, 256, torch.device("cpu"))
    positions = torch.randperm(256)[:num_tokens]
    q, k = _qkv_views(num_tokens, 9, 3, head_dim, torch.float32, torch.device("cpu"))
    # HF's tables repeat the D/2 frequencies: cos = cat(cos_half, cos_half).
    cos_half, sin_half = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos_half, cos_half], -1), torch.cat([sin_half, sin_half], -1)  # [T, D]
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    out_q, out_k = rotary_embedding_ref(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(out_q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, expected_k, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("num_tokens", "num_q_heads", "num_kv_heads", "head_dim"),
                         [(1, 4, 4, 32), (7, 9, 3, 64), (37, 8, 2, 48)])
def test_kernel_matches_ref(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype, device: torch.device, tol: dict[str, float]) -> None:
    cache = cos_sin_cache(LLAMA3_ROPE, head_dim, 512, device)
    positions = torch.randint(0, 512, (num_tokens,), device=device)  # out of order, may repeat
    q, k = _qkv_views(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device)
    expected_q, expected_k = rotary_embedding_ref(positions, q.clone(), k.clone(), cache)
    out_q, out_k = rotary_embedding_triton(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(out_q, expected_q, **tol)
    torch.testing.assert_close(out_k, expected_k, **tol)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_leaves_v_alone(device: torch.device) -> None:
    # q and k are views of a buffer that also holds v: writes must stay inside q and k.
    qkv = torch.randn(5, (4 + 2 + 2) * 32, device=device)
    v_before = qkv[:, 6 * 32:].clone()
    q, k = qkv[:, :4 * 32].view(5, 4, 32), qkv[:, 4 * 32:6 * 32].view(5, 2, 32)
    rotary_embedding_triton(torch.arange(5, device=device), q, k, cos_sin_cache(RopeConfig(), 32, 8, device))
    torch.testing.assert_close(qkv[:, 6 * 32:], v_before, atol=0, rtol=0)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_rejects_partial_rotary(device: torch.device) -> None:
    q, k = torch.randn(2, 4, 64, device=device), torch.randn(2, 2, 64, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding_triton(torch.zeros(2, dtype=torch.int64, device=device), q, k,
                                torch.randn(8, 32, device=device))

"""prefill_attention: kernel vs reference on packed variable-length batches; reference vs dense softmax."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton

# (Hq, Hkv, D): a non-power-of-two GQA group, plain MHA, and a group of 4 with a ragged head_dim.
HEADS = [(9, 3, 64), (4, 4, 32), (8, 2, 48)]


def _packed(seq_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, ...]:
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    bounds = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return q, k, v, cu_seqlens


def _dense_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                  scale: float) -> torch.Tensor:
    """All tokens against all, masked to 'same sequence and not in the future': no per-sequence loop."""
    seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    pos = torch.arange(q.shape[0])
    is_visible = (seq_ids[:, None] == seq_ids[None, :]) & (pos[:, None] >= pos[None, :])  # [T, T]
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, Hq, D]
    scores = torch.einsum("thd,shd->hts", q, k_full) * scale
    probs = scores.masked_fill(~is_visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v_full)


@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_ref_matches_dense(heads: tuple[int, int, int]) -> None:
    seq_lens = [5, 1, 12]
    q, k, v, cu_seqlens = _packed(seq_lens, *heads, torch.float32, torch.device("cpu"))
    scale = heads[2] ** -0.5
    torch.testing.assert_close(prefill_attention_ref(q, k, v, cu_seqlens, max(seq_lens), scale),
                               _dense_masked(q, k, v, seq_lens, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("seq_lens", [[1], [37], [7, 1, 20]], ids=str)
def test_kernel_matches_ref(heads: tuple[int, int, int], seq_lens: list[int], dtype: torch.dtype,
                            device: torch.device, tol: dict[str, float]) -> None:
    q, k, v, cu_seqlens = _packed(seq_lens, *heads, dtype, device)
    scale = heads[2] ** -0.5
    expected = prefill_attention_ref(q, k, v, cu_seqlens, max(seq_lens), scale)
    out = prefill_attention_triton(q, k, v, cu_seqlens, max(seq_lens), scale)
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_multiple_query_tiles_and_strided_inputs(device: torch.device) -> None:
    # 150 tokens > the 128-query tile: several query blocks and key tiles; q/k/v views of one qkv buffer.
    seq_lens, (num_q_heads, num_kv_heads, head_dim) = [150, 9], (4, 2, 16)
    num_tokens = sum(seq_lens)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    cu_seqlens = torch.tensor([0, 150, 159], dtype=torch.int32, device=device)
    expected = prefill_attention_ref(q, k, v, cu_seqlens, 150, 0.25)
    torch.testing.assert_close(prefill_attention_triton(q, k, v, cu_seqlens, 150, 0.25), expected,
                               atol=1e-4, rtol=1e-4)

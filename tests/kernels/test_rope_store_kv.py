"""rope_store_kv: the fused kernel equals rotary_embedding followed by store_kv (kernels bit for bit, and the
references), on strided views of a merged qkv output, GQA, ragged head_dim, padding slots, fp8 caches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tandem.common.config import RopeConfig
from tandem.engine.rope import cos_sin_cache
from tandem.kernels.fp8_kv import FP8_KV_DTYPE
from tandem.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton
from tandem.kernels.rotary_embedding import rotary_embedding_ref, rotary_embedding_triton
from tandem.kernels.store_kv import store_kv_ref, store_kv_triton

LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
NUM_LAYERS, NUM_BLOCKS = 2, 7


def _inputs(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            is_fp8: bool, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """q, k, v as views of one merged qkv output; layer 1's caches of a [L, 2, N, B, Hkv, D] pool holding
    noise; random distinct slots, about a quarter -1."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    pool = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, block_size, num_kv_heads, head_dim, device=device)
    pool = pool.to(FP8_KV_DTYPE if is_fp8 else dtype)
    slots = torch.randperm(NUM_BLOCKS * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.25] = -1
    inputs = {"positions": torch.randint(0, 512, (num_tokens,), device=device),
              "q": q.view(num_tokens, num_q_heads, head_dim), "k": k.view(num_tokens, num_kv_heads, head_dim),
              "v": v.view(num_tokens, num_kv_heads, head_dim),
              "cos_sin_cache": cos_sin_cache(LLAMA3_ROPE, head_dim, 512, device),
              "k_cache": pool[1, 0], "v_cache": pool[1, 1], "slot_mapping": slots, "qkv": qkv, "pool": pool}
    if is_fp8:  # one layer's [2, Hkv] scales, ranging over a factor of 20
        scales = torch.rand(2, num_kv_heads, device=device) * 0.1 + 0.005
        inputs |= {"k_scale": scales[0], "v_scale": scales[1]}
    return inputs


def _clone(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A deep copy whose views alias the copies of qkv and of the cache pool, as the originals do."""
    qkv, pool = inputs["qkv"].clone(), inputs["pool"].clone()
    q, k, v = qkv.split([inputs["q"][0].numel(), inputs["k"][0].numel(), inputs["v"][0].numel()], dim=-1)
    return inputs | {"qkv": qkv, "pool": pool, "q": q.view(inputs["q"].shape), "k": k.view(inputs["k"].shape),
                     "v": v.view(inputs["v"].shape), "k_cache": pool[1, 0], "v_cache": pool[1, 1]}


def _call(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: dict[str, torch.Tensor]) -> None:
    args = {name: value for name, value in inputs.items() if name not in ("qkv", "pool")}
    q, k = fn(**args)
    assert q.data_ptr() == inputs["q"].data_ptr() and k.data_ptr() == inputs["k"].data_ptr()  # in place


def _rope_then_store(rotary: Callable[..., Any], store: Callable[..., Any]
                     ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The unfused pair, with the fused op's signature."""
    def composed(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, **scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rotary(positions, q, k, cos_sin_cache)
        store(k, v, k_cache, v_cache, slot_mapping, **scales)
        return q, k
    return composed


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t


CASES = [(1, 4, 4, 32, 16), (7, 9, 3, 48, 8), (13, 8, 2, 80, 4)]  # (T, Hq, Hkv, D, block_size)


@pytest.mark.parametrize("is_fp8", [False, True], ids=["same_dtype", "fp8"])
def test_ref_is_rotary_then_store(is_fp8: bool) -> None:
    inputs = _inputs(7, 9, 3, 48, 8, is_fp8, torch.float32, torch.device("cpu"))
    expected = _clone(inputs)
    _call(_rope_then_store(rotary_embedding_ref, store_kv_ref), expected)
    _call(rope_store_kv_ref, inputs)
    assert torch.equal(inputs["qkv"], expected["qkv"])
    assert torch.equal(_as_bits(inputs["pool"]), _as_bits(expected["pool"]))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("is_fp8", [False, True], ids=["same_dtype", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_is_rotary_then_store(case: tuple[int, ...], is_fp8: bool, dtype: torch.dtype,
                                     device: torch.device, tol: dict[str, float]) -> None:
    inputs = _inputs(*case, is_fp8, dtype, device)
    unfused, reference = _clone(inputs), _clone(inputs)
    _call(_rope_then_store(rotary_embedding_triton, store_kv_triton), unfused)
    _call(rope_store_kv_ref, reference)
    _call(rope_store_kv_triton, inputs)
    # The unfused kernels do the same arithmetic: q, k, v (untouched) and every cache byte, bit for bit.
    assert torch.equal(inputs["qkv"], unfused["qkv"])
    assert torch.equal(_as_bits(inputs["pool"]), _as_bits(unfused["pool"]))
    # The references, within rounding (a last-bit difference in the rotated k may move an e4m3 code by one
    # step, 2^-3 of the value, once dequantized).
    torch.testing.assert_close(inputs["qkv"], reference["qkv"], **tol)
    if is_fp8:
        scales = torch.stack([inputs["k_scale"], inputs["v_scale"]])[:, None, None, :, None]  # [2, 1, 1, Hkv, 1]
        torch.testing.assert_close(inputs["pool"][1].float() * scales, reference["pool"][1].float() * scales,
                                   atol=1e-6, rtol=2.0**-3)
        assert torch.equal(_as_bits(inputs["pool"][0]), _as_bits(reference["pool"][0]))  # other layers untouched
    else:
        torch.testing.assert_close(inputs["pool"], reference["pool"], **tol)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_checks_arguments(device: torch.device) -> None:
    inputs = _inputs(3, 4, 2, 16, 8, True, torch.float32, device)
    args = {name: value for name, value in inputs.items() if name not in ("qkv", "pool")}
    with pytest.raises(ValueError, match="rope_store_kv: a torch.float8_e4m3fn cache needs k_scale"):
        rope_store_kv_triton(**(args | {"k_scale": None}))
    with pytest.raises(ValueError, match="rope_store_kv: positions"):
        rope_store_kv_triton(**(args | {"positions": args["positions"][:2]}))
    with pytest.raises(ValueError, match="rope_store_kv: k .* v .* disagree"):
        rope_store_kv_triton(**(args | {"v": args["v"][:, :1]}))

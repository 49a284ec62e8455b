"""fp8_kv: the KV quantizer's round trip and clamping, the calibration helpers, and the shared argument checks."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_kv import (
    FP8_KV_DTYPE,
    check_kv_cache,
    dequantize_kv,
    kv_absmax,
    kv_scales_from_absmax,
    quantize_kv,
)

# e4m3 keeps 3 mantissa bits: a normal value (|x / scale| >= 2^-6) rounds to within 2^-4 of itself; a
# subnormal one to within half its spacing, 2^-10 (times the scale).
REL_ERR = 2.0**-4
SUBNORMAL_ABS_ERR = 2.0**-10


def test_round_trip_within_e4m3_rounding() -> None:
    # [T, Hkv, D] with very different ranges per head, as calibrated per-head scales would see.
    ranges = torch.tensor([0.01, 1.0, 30.0])
    x = torch.randn(37, 3, 48) * ranges[:, None]
    scale = kv_scales_from_absmax(kv_absmax(x, x))[0]
    q = quantize_kv(x, scale)
    assert q.dtype == FP8_KV_DTYPE and q.shape == x.shape
    back = dequantize_kv(q, scale)
    bound = torch.maximum(REL_ERR * x.abs(), SUBNORMAL_ABS_ERR * scale[:, None].expand_as(x))
    assert bool(((back - x).abs() <= bound).all())
    # The absmax lands on 448 / headroom = 224: nothing clips until values double.
    assert torch.equal(q.float().abs().amax(dim=(0, 2)), torch.full((3,), 224.0))


def test_quantize_clamps_instead_of_nan() -> None:
    scale = torch.tensor([1.0, 0.5])
    x = torch.tensor([[[1000.0, -1000.0, 448.0, 460.0]], [[224.0, 300.0, -1e30, 1e-9]]]).transpose(0, 1)
    back = dequantize_kv(quantize_kv(x, scale), scale)  # [1, 2, 4]
    assert not bool(back.isnan().any())
    torch.testing.assert_close(back, torch.tensor([[[448.0, -448.0, 448.0, 448.0], [224.0, 224.0, -224.0, 0.0]]]))


def test_scales_from_absmax() -> None:
    absmax = torch.tensor([[448.0, 0.0], [2.0, 1e-3]])
    scales = kv_scales_from_absmax(absmax, headroom=1.0)
    assert scales.dtype == torch.float32 and bool((scales > 0).all())  # a silent head still gets a scale
    torch.testing.assert_close(scales[0, 0], torch.tensor(1.0))
    torch.testing.assert_close(kv_scales_from_absmax(absmax)[1], absmax[1] * 2 / 448)
    with pytest.raises(ValueError, match="headroom"):
        kv_scales_from_absmax(absmax, headroom=0.5)


def test_kv_absmax_per_head() -> None:
    k, v = torch.zeros(5, 2, 8), torch.zeros(5, 2, 8)
    k[3, 1, 7], v[0, 0, 0] = -6.0, 2.5
    torch.testing.assert_close(kv_absmax(k, v), torch.tensor([[0.0, 6.0], [2.5, 0.0]]))


def test_check_kv_cache_names_the_argument() -> None:
    fp8 = torch.zeros(2, 4, 3, 8, dtype=FP8_KV_DTYPE)
    bf16 = torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16)
    ones = torch.ones(3)
    assert check_kv_cache("op", fp8, fp8, ones, ones, torch.bfloat16, "q")
    assert not check_kv_cache("op", bf16, bf16, None, None, torch.bfloat16, "q")
    bad = [
        ((fp8, fp8, None, ones), "needs k_scale"),
        ((fp8, fp8, ones, None), "needs v_scale"),
        ((fp8, fp8, ones, torch.ones(2)), "v_scale must be float32 \\[3\\]"),
        ((fp8, fp8, ones.double(), ones), "k_scale must be float32"),
        ((bf16, bf16, ones, ones), "k_scale is only for"),
        ((fp8, bf16, ones, ones), "v_cache dtype"),
        ((bf16.float(), bf16.float(), None, None), "!= q dtype"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            check_kv_cache("op", *args, torch.bfloat16, "q")

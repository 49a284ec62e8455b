"""Quantized linears: quantizer error bounds, Triton kernels vs references, the CPU int8 path, bad args.

Run: `TRITON_INTERPRET=1 pytest tests/kernels/test_quant_linear.py` (kernels through the interpreter on
a CPU); without TRITON_INTERPRET the kernel tests skip and the quantizer, reference and CPU tests run.
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_linear import (
    FP8_MAX,
    Fp8LinearConfig,
    add_rms_norm_quantize_fp8_triton,
    fp8_gemm_triton,
    fp8_linear_ref,
    fp8_linear_triton,
    quantize_fp8_activation,
    quantize_fp8_activation_triton,
    quantize_fp8_weight,
    silu_and_mul_quantize_fp8_triton,
)
from tandem.kernels.fused_add_rms_norm import fused_add_rms_norm_triton
from tandem.kernels.int8_linear import (
    INT8_DEQUANT_MIN_M_ENV,
    Int8LinearConfig,
    dequantize_int8_weight,
    dequantize_int8_weight_triton,
    int8_dequant_min_m,
    int8_launch_config,
    int8_linear_cpu,
    int8_linear_ref,
    int8_linear_triton,
    quantize_int8_weight,
)
from tandem.kernels.quant_common import FP8_DTYPE
from tandem.kernels.quant_linear import QuantWeight, quant_linear
from tandem.kernels.rms_norm import rms_norm_triton
from tandem.kernels.silu_and_mul import silu_and_mul_triton

# (M, N, K): one token; K not a multiple of any block and N odd; more rows than one 16-row block.
LINEAR_SHAPES = [(1, 7, 40), (3, 33, 200), (17, 65, 300)]
# e4m3: 3 mantissa bits, so rounding a normal value errs by at most 2^-4 of it; below the smallest
# normal (2^-6) the grid is uniform with step 2^-9, so the error is at most 2^-10 (times the scale).
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------------------------------------------
# Quantizers
# ---------------------------------------------------------------------------------------------------


def test_int8_per_channel_absmax_error_bound() -> None:
    w = torch.randn(37, 96) * torch.rand(37, 1) * 3  # rows of different ranges
    q, s = quantize_int8_weight(w, clip_search=False)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (37,)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1) == 127).all()  # each row's absmax maps to 127
    err = (w - dequantize_int8_weight(q, s)).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()


def test_int8_clip_search_bound_and_gain() -> None:
    w = torch.randn(64, 512)
    q_abs, s_abs = quantize_int8_weight(w, clip_search=False)
    q, s = quantize_int8_weight(w)
    deq = dequantize_int8_weight(q, s)
    err = (w - deq).abs()
    # Inside the clip range: half a step; beyond it the clipped amount.
    bound = torch.maximum(s[:, None] / 2, w.abs() - 127 * s[:, None])
    assert (err <= bound * (1 + 1e-5) + 1e-7).all()
    mse = (w - deq).pow(2).sum(dim=1)
    mse_abs = (w - dequantize_int8_weight(q_abs, s_abs)).pow(2).sum(dim=1)
    assert (mse <= mse_abs * (1 + 1e-6)).all()  # never worse per row
    assert mse.sum() < 0.99 * mse_abs.sum()     # and better overall (~3% on Gaussian rows)


@pytest.mark.parametrize("clip_search", [False, True], ids=["absmax", "search"])
def test_int8_groupwise(clip_search: bool) -> None:
    w = torch.randn(9, 128)
    w[:, :32] *= 10  # one group with a much larger range: group scales adapt, a channel scale could not
    q, s = quantize_int8_weight(w, group_size=32, clip_search=clip_search)
    assert s.shape == (9, 4) and s.dtype == torch.float32
    assert (s[:, 0] > 5 * s[:, 1]).all()
    deq = dequantize_int8_weight(q, s)
    step = s.repeat_interleave(32, dim=1)
    bound = torch.maximum(step / 2, w.abs() - 127 * step)
    assert ((w - deq).abs() <= bound * (1 + 1e-5) + 1e-7).all()
    q_channel, s_channel = quantize_int8_weight(w, clip_search=clip_search)
    assert (w - deq).pow(2).sum() < (w - dequantize_int8_weight(q_channel, s_channel)).pow(2).sum()


def test_int8_zero_rows_and_bf16_input() -> None:
    w = torch.randn(4, 64, dtype=torch.bfloat16)
    w[1] = 0
    q, s = quantize_int8_weight(w)
    assert (q[1] == 0).all() and torch.isfinite(s).all()
    assert (dequantize_int8_weight(q, s)[1] == 0).all()


def _check_e4m3_rows(t: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (t.shape[0],)
    torch.testing.assert_close(s, t.float().abs().amax(dim=1) / FP8_MAX)
    err = (t.float() - q.float() * s[:, None]).abs()
    bound = torch.maximum(E4M3_REL * t.float().abs(), E4M3_SUBNORMAL_ABS * s[:, None])
    assert (err <= bound * (1 + 1e-6)).all()


def test_fp8_weight_and_activation_quantizers() -> None:
    w = torch.randn(33, 80) * torch.rand(33, 1)
    _check_e4m3_rows(w, *quantize_fp8_weight(w))
    x = torch.randn(5, 80, dtype=torch.bfloat16) * 30
    qx, sx = quantize_fp8_activation(x)
    _check_e4m3_rows(x, qx, sx)
    assert (qx.float().abs().amax(dim=1) == FP8_MAX).all()  # each token's absmax maps to 448
    qz, sz = quantize_fp8_activation(torch.zeros(2, 16))
    assert (qz.float() == 0).all() and torch.isfinite(sz).all()


# ---------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------


def test_int8_ref_is_dequantized_matmul() -> None:
    x, w, bias = torch.randn(3, 64), torch.randn(10, 64), torch.randn(10)
    q, s = quantize_int8_weight(w, group_size=16)
    expected = x.double() @ dequantize_int8_weight(q, s).double().T + bias.double()
    torch.testing.assert_close(int8_linear_ref(x, q, s, bias).double(), expected, atol=1e-5, rtol=1e-5)
    assert rel_err(int8_linear_ref(x, q, s), x @ w.T) < 0.01  # int8 rounding costs < 1%


def test_fp8_ref_against_float64() -> None:
    # Every product x_k w_k is off by |x^ w^ - x w| <= |x^ - x| (|w| + |w^ - w|) + |x| |w^ - w|,
    # with each factor's error bounded as in _check_e4m3_rows; fp32 accumulation adds ~1e-6.
    x, w, bias = torch.randn(6, 256) * 4, torch.randn(40, 256) * 0.05, torch.randn(40)
    qw, sw = quantize_fp8_weight(w)
    out = fp8_linear_ref(x, qw, sw, bias)
    exact = x.double() @ w.double().T + bias.double()
    _, sx = quantize_fp8_activation(x)
    ex = torch.maximum(E4M3_REL * x.double().abs(), E4M3_SUBNORMAL_ABS * sx.double()[:, None])  # [M, K]
    ew = torch.maximum(E4M3_REL * w.double().abs(), E4M3_SUBNORMAL_ABS * sw.double()[:, None])  # [N, K]
    bound = ex @ (w.double().abs() + ew).T + x.double().abs() @ ew.T
    assert ((out.double() - exact).abs() <= bound + 1e-4).all()
    # On random data the errors mostly cancel: ~2-3% of the output's norm for two e4m3 roundings.
    assert rel_err(out - bias, exact - bias.double()) < 0.06


# ---------------------------------------------------------------------------------------------------
# Triton kernels (CUDA, or the interpreter)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("small_m", [False, None], ids=["gemm", "auto"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=str)
def test_int8_kernel_per_channel(shape: tuple[int, int, int], has_bias: bool, small_m: bool | None,
                                 dtype: torch.dtype, device: torch.device, tol: dict[str, float]) -> None:
    # small_m None: M <= 16 takes the small-M kernel, M = 17 the GEMM.
    m, n, k = shape
    x = torch.randn(m, k, device=device).to(dtype)
    q, s = quantize_int8_weight(torch.randn(n, k, device=device) / k**0.5)
    bias = torch.randn(n, device=device).to(dtype) if has_bias else None
    out = int8_linear_triton(x, q, s, bias, small_m=small_m)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, int8_linear_ref(x, q, s, bias), atol=tol["atol"], rtol=tol["rtol"])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("split_k", [2, 3], ids=["split2", "split3"])
def test_int8_kernel_split_k(split_k: int, device: torch.device) -> None:
    # Splits of whole 32-wide K tiles: 300 inputs -> 5 tiles (split 2: 3 + 2; split 3: 2 + 2 + 1).
    x, bias = torch.randn(3, 300, device=device), torch.randn(33, device=device)
    q, s = quantize_int8_weight(torch.randn(33, 300, device=device) / 300**0.5)
    config = Int8LinearConfig(block_m=16, block_n=16, block_k=32, split_k=split_k, num_warps=4, num_stages=2)
    torch.testing.assert_close(int8_linear_triton(x, q, s, bias, config=config), int8_linear_ref(x, q, s, bias),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("split_k", [1, 2], ids=["nosplit", "split2"])
@pytest.mark.parametrize("group_size", [16, 48], ids=["g16", "g48"])
def test_int8_kernel_groupwise(group_size: int, split_k: int, device: torch.device) -> None:
    # g48: the K tile shrinks to 16 (the largest power of two dividing 48).
    m, n, k = 5, 19, 3 * 48
    x, bias = torch.randn(m, k, device=device), torch.randn(n, device=device)
    q, s = quantize_int8_weight(torch.randn(n, k, device=device) / k**0.5, group_size=group_size)
    config = int8_launch_config(m, n, k, group_size, num_sms=4)._replace(split_k=split_k)
    assert group_size % config.block_k == 0
    torch.testing.assert_close(int8_linear_triton(x, q, s, bias, config=config), int8_linear_ref(x, q, s, bias),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("group_size", [None, 48], ids=["channel", "g48"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_int8_dequantize_kernel_rounds_once_like_the_reference(group_size: int | None, out_dtype: torch.dtype,
                                                               device: torch.device) -> None:
    # 37 x 288: neither a multiple of the 32 x 256 tile.
    q, s = quantize_int8_weight(torch.randn(37, 288, device=device), group_size=group_size)
    out = dequantize_int8_weight_triton(q, s, out_dtype)
    assert out.dtype == out_dtype and out.shape == q.shape
    ref = dequantize_int8_weight(q, s).to(out_dtype)
    if device.type == "cuda":
        assert torch.equal(out, ref)  # q * s in fp32, rounded to nearest once
    else:  # Triton's interpreter truncates fp32 -> bf16: within one unit in the last place
        ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[out_dtype]
        torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=0)


@pytest.fixture()
def dequant_min_m(monkeypatch: pytest.MonkeyPatch):
    def set_to(value: str) -> None:
        monkeypatch.setenv(INT8_DEQUANT_MIN_M_ENV, value)
        int8_dequant_min_m.cache_clear()
    yield set_to
    monkeypatch.delenv(INT8_DEQUANT_MIN_M_ENV, raising=False)
    int8_dequant_min_m.cache_clear()


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_int8_large_m_dequantizes_once_and_calls_the_dense_gemm(has_bias: bool, dtype: torch.dtype,
                                                                 device: torch.device, tol: dict[str, float],
                                                                 dequant_min_m, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    # M at the threshold takes dequantize + F.linear (bitwise that); one row fewer, and a threshold of 0, keep the
    # int8 GEMM. Every path matches the reference.
    import tandem.kernels.int8_linear as int8_linear

    dequantized: list[int] = []

    def counting(qweight: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        dequantized.append(qweight.shape[0])
        return dequantize_int8_weight_triton(qweight, scales, out_dtype)

    monkeypatch.setattr(int8_linear, "dequantize_int8_weight_triton", counting)
    dequant_min_m("20")
    n, k = 33, 64
    q, s = quantize_int8_weight(torch.randn(n, k, device=device) / k**0.5)
    bias = torch.randn(n, device=device).to(dtype) if has_bias else None
    x = torch.randn(20, k, device=device).to(dtype)
    out = int8_linear_triton(x, q, s, bias)
    assert dequantized == [n]
    w = dequantize_int8_weight_triton(q, s, dtype)
    assert torch.equal(out, torch.nn.functional.linear(x, w, bias))
    torch.testing.assert_close(out, int8_linear_ref(x, q, s, bias), atol=tol["atol"], rtol=tol["rtol"])
    below = int8_linear_triton(x[:19], q, s, bias)
    assert dequantized == [n]
    torch.testing.assert_close(below, int8_linear_ref(x[:19], q, s, bias), atol=tol["atol"], rtol=tol["rtol"])
    dequant_min_m("0")  # never
    torch.testing.assert_close(int8_linear_triton(x, q, s, bias), int8_linear_ref(x, q, s, bias),
                               atol=tol["atol"], rtol=tol["rtol"])
    assert dequantized == [n]


def test_int8_dequant_threshold_names_the_variable_on_bad_values(dequant_min_m) -> None:
    for bad in ("many", "-1"):
        dequant_min_m(bad)
        with pytest.raises(ValueError, match=INT8_DEQUANT_MIN_M_ENV):
            int8_dequant_min_m()


@pytest.mark.usefixtures("needs_triton")
def test_int8_kernel_strided_rows_and_empty(device: torch.device) -> None:
    wide = torch.randn(4, 96, device=device)
    x = wide[:, :64]  # rows read by stride
    q, s = quantize_int8_weight(torch.randn(24, 64, device=device))
    torch.testing.assert_close(int8_linear_triton(x, q, s), int8_linear_ref(x, q, s), atol=1e-4, rtol=1e-4)
    assert int8_linear_triton(torch.empty(0, 64, device=device), q, s).shape == (0, 24)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=str)
def test_fp8_kernel(shape: tuple[int, int, int], has_bias: bool, dtype: torch.dtype,
                    device: torch.device) -> None:
    # The W8A8 GEMM (small_m=False: at M <= 16 the default is the weight-only kernel, tested below).
    # Same fp8 operands as the reference (the kernel's activation quantizer is bit-identical to the
    # reference's), so only the accumulation differs: exact products, fp32 sums.
    m, n, k = shape
    x = (torch.randn(m, k, device=device) * 3).to(dtype)
    qw, sw = quantize_fp8_weight(torch.randn(n, k, device=device) / k**0.5)
    bias = torch.randn(n, device=device).to(dtype) if has_bias else None
    out = fp8_linear_triton(x, qw, sw, bias, small_m=False)
    ref = fp8_linear_ref(x, qw, sw, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    # Hopper's fp8 MMA adds with reduced precision between promotions: ~1e-4 of the output's scale.
    limit = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=limit * ref.float().abs().max().item(), rtol=limit)


@pytest.mark.usefixtures("needs_triton")
def test_fp8_kernel_small_config(device: torch.device) -> None:
    # Several M and N tiles and a ragged K tile, whatever fp8_launch_config picks.
    x = torch.randn(37, 150, device=device)
    qw, sw = quantize_fp8_weight(torch.randn(45, 150, device=device))
    config = Fp8LinearConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, max_imprecise_acc=32)
    out = fp8_linear_triton(x, qw, sw, config=config)
    ref = fp8_linear_ref(x, qw, sw)
    torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fp8_activation_kernel_bit_exact(dtype: torch.dtype, device: torch.device) -> None:
    # Random rows of different ranges (K > one 2048 block, ragged), a zero run, and one row holding every
    # finite e4m3 value and every midpoint between neighbours (scale 1): ties must round to even.
    x = torch.randn(4, 2100, device=device) * torch.tensor([[1e-3], [1.0], [30.0], [1e3]], device=device)
    x[0, :10] = 0
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).to(device)
    rows = [x.to(dtype)]
    if dtype == torch.float32:  # the midpoints need more bits than bf16 has
        rows.append(torch.nn.functional.pad(ties, (0, 2100 - ties.numel()))[None])
    xs = torch.cat(rows)
    q_ref, s_ref = quantize_fp8_activation(xs)
    q, s = quantize_fp8_activation_triton(xs)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))



@pytest.mark.usefixtures("needs_triton")
def test_fp8_silu_quantize_kernel_is_silu_and_mul_then_quantize(dtype: torch.dtype, device: torch.device) -> None:
    """`silu_and_mul_quantize_fp8_triton` (the silu_quant fusion) bit for bit against the two kernels it replaces,
    and the GEMM over its output (`fp8_gemm_triton`) against `fp8_linear_triton` over the unfused activation: K
    past one 1,024 block and ragged, rows of different ranges, a zero row."""
    gate_up = torch.randn(5, 2 * 1500, device=device) * torch.tensor([[1e-3], [1.0], [8.0], [30.0], [0.0]],
                                                                      device=device)
    gate_up = gate_up.to(dtype)
    activation = silu_and_mul_triton(gate_up)
    q_ref, s_ref = quantize_fp8_activation_triton(activation)
    q, s = silu_and_mul_quantize_fp8_triton(gate_up)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    qweight, w_scales = quantize_fp8_weight(torch.randn(48, 1500, device=device))
    expected = fp8_linear_triton(activation, qweight, w_scales, small_m=False)
    assert torch.equal(fp8_gemm_triton(q, s, qweight, w_scales, None, dtype), expected)
    with pytest.raises(ValueError, match="fp8_gemm"):
        fp8_gemm_triton(q, s[:2], qweight, w_scales, None, dtype)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("has_residual", [False, True], ids=["first", "residual"])
def test_fp8_norm_quantize_kernel_is_the_norm_then_quantize(has_residual: bool, dtype: torch.dtype,
                                                           device: torch.device) -> None:
    """`add_rms_norm_quantize_fp8_triton` (the norm_quant fusion) bit for bit against the norm kernel and the
    quantization it replaces, the new residual included: a ragged hidden size, rows of different ranges, a zero row."""
    ranges = torch.tensor([[1e-3], [1.0], [8.0], [30.0], [0.0]], device=device)
    x = (torch.randn(5, 300, device=device) * ranges).to(dtype)
    residual = (torch.randn(5, 300, device=device) * ranges).to(dtype) if has_residual else None
    weight = (torch.rand(300, device=device) + 0.5).to(dtype)
    if residual is None:
        normed, expected_residual = rms_norm_triton(x.clone(), weight, 1e-5), x.clone()
    else:
        normed, expected_residual = fused_add_rms_norm_triton(x.clone(), residual.clone(), weight, 1e-5)
    q_ref, s_ref = quantize_fp8_activation_triton(normed)
    x_before = x.clone()
    q, s, new_residual = add_rms_norm_quantize_fp8_triton(x, residual, weight, 1e-5)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(x, x_before)  # x is read, never written
    if residual is not None:
        assert new_residual.data_ptr() == residual.data_ptr()  # in place, as fused_add_rms_norm
    with pytest.raises(ValueError, match="weight shape"):
        add_rms_norm_quantize_fp8_triton(x, residual, weight[:10], 1e-5)


# ---------------------------------------------------------------------------------------------------
# CPU int8 path (torch._weight_int8pack_mm)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", [(1, 7, 64), (3, 33, 192), (17, 65, 576)], ids=str)
def test_int8_cpu_matches_ref(shape: tuple[int, int, int], has_bias: bool) -> None:
    # K a multiple of 16: the op's bf16 kernel; bf16 activations cost ~0.2% relative.
    m, n, k = shape
    x, bias = torch.randn(m, k), (torch.randn(n) if has_bias else None)
    q, s = quantize_int8_weight(torch.randn(n, k) / k**0.5)
    out = int8_linear_cpu(x, q, s, bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert rel_err(out, int8_linear_ref(x, q, s, bias)) < 5e-3


def test_int8_cpu_odd_k_groups_and_bf16() -> None:
    x, bias = torch.randn(3, 200), torch.randn(33)
    q, s = quantize_int8_weight(torch.randn(33, 200))
    # K=200 is not a multiple of 16: the op's fp32 kernel, exact up to fp32 rounding.
    torch.testing.assert_close(int8_linear_cpu(x, q, s, bias), int8_linear_ref(x, q, s, bias),
                               atol=1e-4, rtol=1e-4)
    qg, sg = quantize_int8_weight(torch.randn(33, 192), group_size=64)
    xg = torch.randn(3, 192)
    assert rel_err(int8_linear_cpu(xg, qg, sg), int8_linear_ref(xg, qg, sg)) < 5e-3
    xb = xg.bfloat16()
    out = int8_linear_cpu(xb, qg, sg)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, int8_linear_ref(xb, qg, sg)) < 1e-2


# ---------------------------------------------------------------------------------------------------
# QuantWeight / quant_linear
# ---------------------------------------------------------------------------------------------------


def test_quant_weight_apply_torch_and_cpu() -> None:
    linear = torch.nn.Linear(64, 24)
    x = torch.randn(2, 3, 64)  # leading dimensions are flattened and restored
    qw = QuantWeight.quantize(linear.weight, "int8", bias=linear.bias)
    with torch.no_grad():
        expected = linear(x)
    for backend in ("torch", "cpu", "auto"):
        out = qw.apply(x, backend)
        assert out.shape == (2, 3, 24)
        assert rel_err(out, expected) < 0.02
    f8 = QuantWeight.quantize(linear.weight, "fp8", bias=linear.bias)
    assert rel_err(f8.apply(x, "torch"), expected) < 0.1
    assert rel_err(f8.dequantize(), linear.weight) < 0.05
    with pytest.raises(ValueError, match="no 'cpu' kernel"):
        f8.apply(x, "cpu")


@pytest.mark.usefixtures("needs_triton")
def test_quant_weight_apply_triton(device: torch.device) -> None:
    w, x = torch.randn(24, 64, device=device), torch.randn(5, 64, device=device)
    for kind, group_size in (("int8", None), ("int8", 32), ("fp8", None)):
        qw = QuantWeight.quantize(w, kind, group_size=group_size)
        torch.testing.assert_close(quant_linear(x, qw, "triton"), quant_linear(x, qw, "torch"),
                                   atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------
# Bad arguments
# ---------------------------------------------------------------------------------------------------


def test_bad_args_raise_naming_the_argument() -> None:
    x = torch.randn(3, 64)
    q, s = quantize_int8_weight(torch.randn(8, 64))
    qf, sf = quantize_fp8_weight(torch.randn(8, 64))
    cases = [
        (lambda: int8_linear_ref(x[None], q, s), "x must be 2-D"),
        (lambda: int8_linear_ref(x.double(), q, s), "x must be float32"),
        (lambda: int8_linear_ref(x, q.float(), s), "qweight must be torch.int8"),
        (lambda: int8_linear_ref(x, q[:, :32], s), "qweight shape"),
        (lambda: int8_linear_ref(x, q, s.half()), "scales must be float32"),
        (lambda: int8_linear_ref(x, q, s[:4]), "scales shape"),
        (lambda: int8_linear_ref(x, q, torch.ones(8, 5)), "scales shape"),  # 5 groups do not divide 64
        (lambda: int8_linear_ref(x, q, s, torch.ones(7)), "bias shape"),
        (lambda: int8_linear_cpu(x, q.T.contiguous().T, s), "qweight must be contiguous"),
        (lambda: fp8_linear_ref(x, q, s), "qweight must be torch.float8_e4m3fn"),
        (lambda: fp8_linear_ref(x, qf, torch.ones(8, 2)), "scales shape"),
        (lambda: quantize_int8_weight(torch.randn(8, 64), group_size=48), "group_size 48"),
        (lambda: quantize_int8_weight(torch.randn(8, 64, 2)), "w must be 2-D"),
        (lambda: quantize_fp8_activation(torch.randn(64)), "x must be a 2-D"),
        (lambda: QuantWeight("int4", q, s), "kind 'int4'"),
        (lambda: QuantWeight("int8", q, s, group_size=16), "scales shape"),
        (lambda: quant_linear(x, QuantWeight("int8", q, s), "cuda"), "backend 'cuda'"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.usefixtures("needs_triton")
def test_kernel_bad_args_raise(device: torch.device) -> None:
    x = torch.randn(3, 64, device=device)
    q, s = quantize_int8_weight(torch.randn(8, 64, device=device), group_size=8)
    with pytest.raises(ValueError, match="group size 8"):
        int8_linear_triton(x, q, s)
    q, s = quantize_int8_weight(torch.randn(8, 64, device=device))
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        int8_linear_triton(torch.randn(64, 3, device=device).T, q, s)
    with pytest.raises(ValueError, match="qweight shape"):
        int8_linear_triton(x, q[:, :32].contiguous(), s)
    qf, sf = quantize_fp8_weight(torch.randn(8, 64, device=device))
    with pytest.raises(ValueError, match="bias shape"):
        fp8_linear_triton(x, qf, sf, torch.ones(9, device=device))

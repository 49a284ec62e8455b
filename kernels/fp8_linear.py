"""FP8 e4m3 linear (W8A8): the quantizers, the activation-quantizing kernel, the Triton GEMM on the fp8 tensor
cores and the references. Weights are [N, K] like `nn.Linear.weight`, activations x [M, K], outputs [M, N] in x's
dtype; `tandem.kernels.quant_linear` dispatches (`QuantWeight`).

FP8 W8A8: e4m3 weights with per-output-channel scales; activations quantized per token on the fly by
a one-launch Triton kernel (bit-identical to the torch quantizer, on CUDA and in the interpreter). The
GEMM multiplies the fp8 operands on Hopper's fp8 tensor cores, fp32 accumulation, and scales by
x_scale[m] * w_scale[n] in the epilogue.
At small M the weight-only small-M kernel runs instead (`tandem.kernels.quant_small_m`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.kernels._triton import (
    check_last_dim_contiguous,
    check_launchable,
    pdl_prologue,
    tl,
    triton,
    use_pdl,
)
from tandem.kernels.quant_common import ACTIVATION_DTYPES, FP8_DTYPE, MIN_AMAX, check_linear_args, num_sms
from tandem.kernels.quant_small_m import SmallMConfig, SmallMWorkspace, small_m_linear_triton, use_small_m
from tandem.kernels.rms_norm import _rms_normalize, row_block_config

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_INV_FP8_MAX = 1.0 / FP8_MAX


# ----------------------------------------------------------------------------------------------------
# Quantizers (pure torch, any device)
# ----------------------------------------------------------------------------------------------------


def _fp8_quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax e4m3 quantization of a 2-D tensor: (float8_e4m3fn, scales float32 [rows])."""
    tf = t.float()
    # Times the fp32 reciprocal, not divided by 448: torch's CUDA division by a Python scalar multiplies
    # by the reciprocal, its CPU one divides, so only this gives the same scales on both (and in Triton).
    scales = tf.abs().amax(dim=1).clamp_min_(MIN_AMAX) * _INV_FP8_MAX
    # The cast rounds to nearest even; the clamp guards the rounding of x / scale past 448.
    q = (tf / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


@torch.no_grad()
def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (qweight float8_e4m3fn [N, K], scales float32 [N]); per output channel, absmax/448."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_weight: w must be a 2-D float [N, K], got {w.dtype} {tuple(w.shape)}")
    return _fp8_quantize_rows(w)


def quantize_fp8_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qx float8_e4m3fn [M, K], scales float32 [M]); dynamic, per token, absmax/448."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize_fp8_activation: x must be a 2-D float [M, K], got {x.dtype} "
                         f"{tuple(x.shape)}")
    return _fp8_quantize_rows(x)


def dequantize_fp8_weight(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(qweight float8_e4m3fn [N, K], scales [N]) -> float32 [N, K]."""
    return qweight.float() * scales.float()[:, None]



# ----------------------------------------------------------------------------------------------------
# Kernels, launch settings, wrapper, references
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_linear_kernel(
    a_ptr, b_ptr, a_scales_ptr, b_scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr, MAX_IMPRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # 1-D grid in GROUP_M-row bands (Triton's matmul tutorial): programs running together share
    # A rows and B columns in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = (offs_m % M).to(tl.int64)
    rows_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
        # Both operands K-major, as Hopper's fp8 wgmma wants. MAX_IMPRECISE_ACC: see fp8_launch_config.
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    a_scale = tl.load(a_scales_ptr + rows_a)
    b_scale = tl.load(b_scales_ptr + rows_b)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_b).to(tl.float32)[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _e4m3_bits(y):
    """fp32 y with |y| <= 448 -> its float8_e4m3fn bit pattern (uint8), rounding to nearest even.

    Integer arithmetic on the fp32 bits rather than Triton's fp32 -> fp8 cast: the interpreter's cast
    rounds differently from CUDA's (e.g. -127.89 -> -64), this gives the same bits as torch's cast on
    both, so the kernel can be checked bit for bit on a CPU.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal (|y| >= 2^-6, fp32 exponent field >= 121): round the 23-bit mantissa to 3 bits, ties to
    # even (a carry rolls into the exponent), then rebias the exponent from 127 to 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal: multiples of 2^-9; |y| * 2^9 is exact, and adding 2^23 rounds it to an integer
    # (ties to even) in the low mantissa bits. 8 (= 2^-6) comes out as the smallest normal's code.
    sub = ((a.to(tl.float32, bitcast=True) * 512.0) + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a >= (121 << 23), normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_quantize_rows_kernel(
    x_ptr, q_ptr, scales_ptr,
    K, stride_xm, stride_qm, min_amax,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # One program per row: a pass for the absmax, a pass to scale, round and store (x is re-read from
    # L2). Same arithmetic as `_fp8_quantize_rows`: scale = absmax * fl32(1/448), IEEE division by it,
    # clamp, round to nearest even.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_row + k + offs, mask=(k + offs) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), min_amax) * INV_FP8_MAX
    tl.store(scales_ptr + row, scale)
    scale_vec = tl.zeros([BLOCK_K], dtype=tl.float32) + scale
    for k in range(0, K, BLOCK_K):
        mask = (k + offs) < K
        x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale_vec), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k + offs, _e4m3_bits(y), mask=mask)


@triton.jit
def _silu_mul_quantize_rows_kernel(
    x_ptr, q_ptr, scales_ptr,
    K, stride_xm, stride_qm, min_amax,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # One program per row of gate_up [M, 2K]: silu(gate) * up made (rounded to the activations' dtype, as
    # `silu_and_mul` stores it), its absmax, then made again from L2 and quantized: `silu_and_mul` followed by
    # `_fp8_quantize_rows_kernel`, bit for bit, without writing the [M, K] activation and reading it back.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    gate_row = x_ptr + row * stride_xm
    up_row = gate_row + K
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask = (k + offs) < K
        gate = tl.load(gate_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(y))
    scale = tl.maximum(tl.max(amax, axis=0), min_amax) * INV_FP8_MAX
    tl.store(scales_ptr + row, scale)
    scale_vec = tl.zeros([BLOCK_K], dtype=tl.float32) + scale
    for k in range(0, K, BLOCK_K):
        mask = (k + offs) < K
        gate = tl.load(gate_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(y, scale_vec), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k + offs, _e4m3_bits(y), mask=mask)


def silu_and_mul_quantize_fp8_triton(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's activation of gate_up [M, 2K] (gate | up), quantized per token for the fp8 GEMM, in one launch:
    (qx float8_e4m3fn [M, K], scales float32 [M]), bit for bit `quantize_fp8_activation(silu_and_mul(gate_up))`."""
    op = "silu_and_mul_quantize_fp8"
    check_launchable(op, gate_up)
    check_last_dim_contiguous(op, gate_up=gate_up)
    if gate_up.dim() != 2 or gate_up.dtype not in ACTIVATION_DTYPES or gate_up.shape[1] % 2:
        raise ValueError(f"{op}: gate_up must be a 2-D float32/bf16/fp16 [M, 2K], got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    qx = torch.empty((m, k), dtype=FP8_DTYPE, device=gate_up.device)
    scales = torch.empty((m,), dtype=torch.float32, device=gate_up.device)
    if m == 0:
        return qx, scales
    block_k = min(1024, max(triton.next_power_of_2(k), 16))
    pdl = use_pdl(gate_up.device)
    _silu_mul_quantize_rows_kernel[(m,)](
        gate_up, qx.view(torch.uint8), scales, k, gate_up.stride(0), k, MIN_AMAX,
        FP8_MAX=FP8_MAX, INV_FP8_MAX=_INV_FP8_MAX, BLOCK_K=block_k,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=8 if block_k >= 1024 else 4,
    )
    return qx, scales


@triton.jit
def _add_rms_norm_quantize_rows_kernel(
    x_ptr, residual_ptr, weight_ptr, q_ptr, scales_ptr,
    hidden_size, stride_x, stride_residual, stride_qm, eps, min_amax,
    HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # One program per row, the row in registers: (x + residual, stored as the new residual), its RMSNorm rounded to
    # x's dtype as `fused_add_rms_norm` / `rms_norm` store it, then that row's absmax and fp8 codes as
    # `_fp8_quantize_rows_kernel` makes them: the normalised row is never written in 16 bits and read back.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        h = (h.to(tl.float32) + residual).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, h, mask=mask)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = _rms_normalize(h.to(tl.float32), weight, hidden_size, eps, x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(normed), axis=0), min_amax) * INV_FP8_MAX
    tl.store(scales_ptr + row, scale)
    scale_vec = tl.zeros([BLOCK_H], dtype=tl.float32) + scale
    y = tl.minimum(tl.maximum(tl.math.div_rn(normed, scale_vec), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, _e4m3_bits(y), mask=mask)


def add_rms_norm_quantize_fp8_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of x (+ residual) quantized per token for the fp8 GEMM, in one launch: x, residual [T, H] (or None),
    weight [H] -> (qx float8_e4m3fn [T, H], scales float32 [T], new residual [T, H]). With a residual, x + residual
    overwrites `residual` (returned), as `fused_add_rms_norm` does; without, x is the new residual. x is not
    written. Bit for bit `quantize_fp8_activation(fused_add_rms_norm(x, residual, weight, eps)[0])` (or of
    `rms_norm(x, weight, eps)`)."""
    op = "add_rms_norm_quantize_fp8"
    tensors = (x, weight) if residual is None else (x, residual, weight)
    check_launchable(op, *tensors)
    check_last_dim_contiguous(op, x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{op}: x must be a 2-D float32/bf16/fp16 [T, H], got {x.dtype} {tuple(x.shape)}")
    num_tokens, hidden_size = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{op}: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} "
                         f"{x.dtype}")
    if weight.shape != (hidden_size,):
        raise ValueError(f"{op}: weight shape {tuple(weight.shape)} != ({hidden_size},)")
    qx = torch.empty((num_tokens, hidden_size), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((num_tokens,), dtype=torch.float32, device=x.device)
    new_residual = x if residual is None else residual
    if num_tokens == 0:
        return qx, scales, new_residual
    block_h, num_warps = row_block_config(op, hidden_size, x.element_size())
    pdl = use_pdl(x.device)
    _add_rms_norm_quantize_rows_kernel[(num_tokens,)](
        x, x if residual is None else residual, weight, qx.view(torch.uint8), scales,
        hidden_size, x.stride(0), new_residual.stride(0), hidden_size, eps, MIN_AMAX,
        HAS_RESIDUAL=residual is not None, FP8_MAX=FP8_MAX, INV_FP8_MAX=_INV_FP8_MAX, BLOCK_H=block_h,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=num_warps,
    )
    return qx, scales, new_residual


def quantize_fp8_activation_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `quantize_fp8_activation` (bit for bit), in one kernel launch instead of ~6
    torch ops that each pass over x: x [M, K] -> (qx float8_e4m3fn [M, K], scales float32 [M])."""
    check_launchable("quantize_fp8_activation", x)
    check_last_dim_contiguous("quantize_fp8_activation", x=x)
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"quantize_fp8_activation: x must be a 2-D float32/bf16/fp16 [M, K], got {x.dtype} "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    qx = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return qx, scales
    # 2048 elements per step: 8 per thread at 8 warps, 16-byte loads of bf16.
    block_k = min(2048, max(triton.next_power_of_2(k), 16))
    pdl = use_pdl(x.device)
    _fp8_quantize_rows_kernel[(m,)](
        x, qx.view(torch.uint8), scales, k, x.stride(0), k, MIN_AMAX,
        FP8_MAX=FP8_MAX, INV_FP8_MAX=_INV_FP8_MAX, BLOCK_K=block_k,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=8 if block_k >= 2048 else 4,
    )
    return qx, scales


class Fp8LinearConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    max_imprecise_acc: int | None  # None: Triton's default (on sm_90: never promote)


def fp8_launch_config(m: int, n: int, k: int, num_sms: int) -> Fp8LinearConfig:
    """Launch settings of `_fp8_linear_kernel`.

    BLOCK_K = 128 fp8 = 128 bytes per operand row. Tiles, from a sweep on an H200 (Triton 3.6; N 4096
    and 28672, K 4096, M 1 to 4096): 16 x 64 for m <= 16 (decode: more programs), 64 x 64 up to 64;
    above, 128 x 256 with 8 warps once those tiles fill the SMs, else 64 x 128.

    Accumulation: Hopper's fp8 MMA adds with reduced precision, and Triton's default on sm_90
    (max_num_imprecise_acc None) never promotes into the fp32 accumulator: relative error vs the
    fp32-emulated reference 1.3e-3 at K=4096, 2.9e-3 at K=14336. Promoting after every K tile
    (max_num_imprecise_acc = BLOCK_K, DeepSeek-V3's scheme) gives 1.3e-4 at both, and is free at
    m <= 64, so decode uses it; at prefill it breaks the MMA pipeline (m=4096, n=28672: 1.96 ms instead
    of 0.85), so prefill keeps the default: its error is still ~20x below e4m3's own rounding (~3%).
    Measured (incl. the activation quantization): m=4096, n=28672, k=4096: 0.85 ms (cuBLAS bf16 1.48,
    torch._scaled_mm 0.87); m=512: 120 us (bf16 191); m=16: 36 us (bf16 62); n=k=4096: m=4096 140 us
    (bf16 201), m<=64 ~16 us (bf16 ~10-13: too few weight bytes for fp8 to pay at decode).
    """
    if m <= 16:
        return Fp8LinearConfig(16, 64, 128, 4, 4, 128)
    if m <= 64:
        return Fp8LinearConfig(64, 64, 128, 4, 4, 128)
    if triton.cdiv(m, 128) * triton.cdiv(n, 256) >= num_sms:
        return Fp8LinearConfig(128, 256, 128, 8, 4, None)
    return Fp8LinearConfig(64, 128, 128, 4, 4, None)


def fp8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
                      bias: torch.Tensor | None = None, *,
                      config: Fp8LinearConfig | SmallMConfig | None = None, small_m: bool | None = None,
                      workspace: SmallMWorkspace | None = None) -> torch.Tensor:
    """FP8 linear: x [M, K] (fp32 / bf16 / fp16), qweight float8_e4m3fn [N, K], w_scales float32
    [N], bias [N] or None -> [M, N] in x.dtype.

    Small M (`use_small_m`, as in `int8_linear_triton`; or a `SmallMConfig`): weight-only,
    `small_m_linear_triton` (x not quantized; reference `fp8_weight_only_ref`). Otherwise W8A8:

    x is quantized per token by `quantize_fp8_activation_triton` (bit-identical to
    `quantize_fp8_activation`; one launch, 2.5 us at M=1 and 26 us at M=4096, K=4096 on an H200, where
    the torch version takes 13 and 216 us), then one Triton GEMM multiplies the fp8 operands (fp32
    accumulation) and scales by x_scale[m] * w_scale[n]. Two launches in all. On CUDA this needs fp8
    tensor cores (compute capability >= 8.9).
    """
    if isinstance(config, SmallMConfig) or (config is None and use_small_m(x.shape[0] if x.dim() == 2 else 0,
                                                                           small_m)):
        return small_m_linear_triton(x, qweight, w_scales, bias, config=config, workspace=workspace)
    check_launchable("fp8_linear", x, qweight, w_scales)
    check_last_dim_contiguous("fp8_linear", x=x, qweight=qweight)
    check_linear_args("fp8_linear", x, qweight, w_scales, bias, FP8_DTYPE, allow_groups=False)
    if bias is not None:
        check_last_dim_contiguous("fp8_linear", bias=bias)
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise ValueError(f"fp8_linear: fp8 tensor cores need compute capability >= 8.9, got "
                         f"{torch.cuda.get_device_capability(x.device)} on {x.device}")
    m, k = x.shape
    n = qweight.shape[0]
    if m == 0 or n == 0:
        return x.new_empty((m, n))
    qx, x_scales = quantize_fp8_activation_triton(x)
    return fp8_gemm_triton(qx, x_scales, qweight, w_scales, bias, x.dtype,
                           config=config if isinstance(config, Fp8LinearConfig) else None)


def fp8_gemm_triton(qx: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, *,
                    config: Fp8LinearConfig | None = None) -> torch.Tensor:
    """The W8A8 GEMM of activations already quantized per token: qx float8_e4m3fn [M, K] with x_scales float32 [M],
    qweight [N, K] with w_scales [N] -> [M, N] in `out_dtype` (what `fp8_linear_triton` runs after its
    quantization, for callers that made qx themselves: `silu_and_mul_quantize_fp8_triton`)."""
    m, k = qx.shape
    n = qweight.shape[0]
    if qx.dtype != FP8_DTYPE or x_scales.shape != (m,) or x_scales.dtype != torch.float32 or qweight.shape[1] != k:
        raise ValueError(f"fp8_gemm: qx must be float8_e4m3fn [M, K] with float32 x_scales [M] and qweight [N, K], "
                         f"got {qx.dtype} {tuple(qx.shape)}, {x_scales.dtype} {tuple(x_scales.shape)}, "
                         f"{tuple(qweight.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m == 0 or n == 0:
        return out
    cfg = config or fp8_launch_config(m, n, k, num_sms(qx.device))
    if cfg.max_imprecise_acc is not None and not 0 <= cfg.max_imprecise_acc <= cfg.block_k:
        raise ValueError(f"fp8_linear: config {cfg} invalid (max_imprecise_acc must lie in [0, block_k])")
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    pdl = use_pdl(qx.device)
    _fp8_linear_kernel[grid](
        qx, qweight, x_scales, w_scales.contiguous(), bias if bias is not None else w_scales, out,
        m, n, k, qx.stride(0), qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GROUP_M=8, MAX_IMPRECISE_ACC=cfg.max_imprecise_acc,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `fp8_linear_triton`, emulated on any device: x quantized per token with
    `quantize_fp8_activation`, the fp8 codes multiplied in fp32 (their products are exact there),
    then scaled by x_scale[m] * w_scale[n] like the kernel's epilogue."""
    check_linear_args("fp8_linear", x, qweight, w_scales, bias, FP8_DTYPE, allow_groups=False)
    qx, x_scales = quantize_fp8_activation(x)
    out = (qx.float() @ qweight.float().T) * x_scales[:, None] * w_scales[None, :]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fp8_weight_only_ref(x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The small-M fp8 contract on any device: x (not quantized) @ dequantized e4m3 weight, in fp32."""
    check_linear_args("fp8_linear", x, qweight, w_scales, bias, FP8_DTYPE, allow_groups=False)
    out = x.float() @ dequantize_fp8_weight(qweight, w_scales).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fp8_linear_torch(x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The "torch" backend of fp8 layers: the same arithmetic as `fp8_linear_triton` picks by M (weight-only
    at small M, `fp8_weight_only_ref`; W8A8 above, `fp8_linear_ref`), so the engine's two paths agree."""
    if use_small_m(x.shape[0], kind="fp8"):
        return fp8_weight_only_ref(x, qweight, w_scales, bias)
    return fp8_linear_ref(x, qweight, w_scales, bias)


"""INT8 weight-only linear (W8A16): the quantizer, the Triton GEMM, the CPU path and the reference. Weights are
[N, K] like `nn.Linear.weight`, activations x [M, K], outputs [M, N] in x's dtype; `tandem.kernels.quant_linear`
dispatches (`QuantWeight`).

INT8 weight-only (the memory-bound decode path): symmetric int8 weights with float32 scales, per output
channel ([N]) or per group of `group_size` consecutive inputs ([N, K // group_size]). The Triton kernel
loads the int8 tile, converts it in registers to x's dtype (exact: |q| <= 127 fits bf16's and fp16's
significands) and multiplies on the tensor cores with fp32 accumulation; the scale multiplies the fp32
accumulator (per channel: once, in the epilogue; per group: each K tile's partial product). No
dequantized weight is ever written to memory, so decode reads 1 byte per weight instead of 2.

Small M (decode; by default fp8 at M <= 4 and int8 at M = 1, as measured: SMALL_M_DEFAULT_MAX_M;
$TANDEM_QUANT_SMALL_M=N sends M <= N of both kinds, 0 turns it off): `small_m_linear_triton` runs instead, a
weight-only GEMV / skinny GEMM (1-byte weights converted in registers, activations as given, so fp8 skips the
activation quantization there; split-K over ~all SMs with the partials reduced in the same launch). Why, and the
design: `tandem.kernels.quant_small_m`. `int8_linear_triton` and `fp8_linear_triton` pick the path by M;
`small_m=True / False` or a config forces one.

CPU: `int8_linear_cpu` keeps the weight int8 in memory and runs `torch._weight_int8pack_mm`. Its
contract in torch 2.13 (checked): A [M, K] (rows may be strided, unit stride along K), B int8 [N, K]
contiguous, scales [N] of A's dtype (no group-wise scales); A may be float32, bfloat16 or float16 and
the output has A's dtype. Only bfloat16 has a vectorized kernel on this AVX2 host, and it needs K to be
a multiple of 16 (otherwise garbage or a segfault); float32 and float16 run a scalar loop 10-30x slower
than oneDNN's fp32 linear. So the wrapper casts x to bf16 (fp32 kernel when K % 16 != 0), multiplies
with unit scales, and applies the fp32 scales to the [M, N] result in fp32 (cheaper in error than
rounding the scales to bf16: 0.23% instead of 0.30% relative error against the int8 weights at
[16, 576] x [3072, 576]; the int8 rounding itself costs ~0.75%).

Measured on this 2-core AMD EPYC (AVX2, no AVX-512), SmolLM2-135M shapes, one thread, p10 of >= 20
calls after warm-up, microseconds, +-15% between runs (two threads show ~8 ms scheduler stalls here,
the other core being busy):

    layer    N x K       M | fp32 F.linear  fp32 oneDNN packed  int8pack_mm bf16  int8_linear_cpu
    qkv      960 x 576   1 |      44             46                  30               42
    qkv      960 x 576  16 |     230            176                 226              244
    o        576 x 576   1 |      27             35                  18               28
    o        576 x 576  16 |     139            111                 135              149
    gate_up 3072 x 576   1 |     136            110                  93              108
    gate_up 3072 x 576  16 |     824            537                 760              795
    down     576 x 1536  1 |      60             61                  45               58
    down     576 x 1536 16 |     367            265                 348              364
    lm_head 49152 x 576  1 |    9719           6933                3720             3873
    lm_head 49152 x 576 16 |   24453          10845               22965            23755
    (int8pack_mm with fp32 x: 584 us for qkv at M=1, 7351 at M=16; 23 ms / 379 ms for lm_head)

So at M=1 the int8 path is 1.8x faster than oneDNN on lm_head and on par (1.0-1.25x) on the small
layers, where the wrapper's three torch calls (~4 us of dispatch each) eat the gain; at M=16 oneDNN
fp32 is 1.3-2.2x faster. Its other win is memory: a quarter of the fp32 weight.
(Command: a loop timing F.linear, torch.ops.mkldnn._linear_pointwise on a
torch.ops.mkldnn._reorder_linear_weight(w, 16) weight, the op and `int8_linear_cpu` with
torch.set_num_threads(1).)
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from tandem.kernels._triton import (
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    pdl_prologue,
    tl,
    triton,
    use_pdl,
)
from tandem.kernels.quant_common import (
    MIN_AMAX,
    check_linear_args,
    int8_bits_default,
    int8_to_float32,
    largest_pow2_divisor,
    num_sms,
    sum_splits_kernel,
)
from tandem.kernels.quant_small_m import SmallMConfig, SmallMWorkspace, small_m_linear_triton, use_small_m

INT8_MAX = 127

# Clipping search of `quantize_int8_weight`: candidate clip levels as fractions of each row's absmax.
# For 8-bit codes the MSE-optimal clip lies within a few percent of the absmax (measured best ratios
# 0.95-1.0 on Gaussian, Laplace and Student-t(3) rows of 4096), so a fine grid near 1 beats a coarse
# wide one (at groups of 128, steps of 0.005 gain 2.5% MSE where steps of 0.01 gain 0.6%).
_CLIP_RATIOS = tuple(1.0 - 0.005 * i for i in range(21))  # 1.0 .. 0.90, absmax first: ties keep it
_LS_REFINE_STEPS = 2
_SEARCH_CHUNK_ELEMENTS = 1 << 22  # rows per search chunk bound the fp32 temporaries to ~16 MB each


# ----------------------------------------------------------------------------------------------------
# Quantizer (pure torch, any device)
# ----------------------------------------------------------------------------------------------------


def _row_codes_error(rows: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """Squared reconstruction error of each row of `rows` [R, C] quantized with `scale` [R, 1]."""
    codes = torch.round(rows / scale).clamp_(-qmax, qmax)
    return (codes.mul_(scale).sub_(rows)).pow_(2).sum(dim=1, keepdim=True)


def _search_int8_scales(rows: torch.Tensor) -> torch.Tensor:
    """Per-row scales [R, 1] minimising the row's squared error, for float32 rows [R, C].

    With isotropic inputs the expected squared error of output channel n is sigma^2 * ||w_n - w^_n||^2,
    so minimising each row's weight MSE minimises its output-channel MSE. Two steps:
      1. clip search: scale = ratio * absmax / 127 for the ratios in _CLIP_RATIOS, keep the best;
      2. least-squares refinement: for the chosen codes q, s* = <w, q> / <q, q> is the optimal scale;
         re-round with it and keep it only where the error drops (alternating, like Lloyd's).
    Every step only accepts improvements, so the result is never worse than plain absmax rounding.
    """
    amax = rows.abs().amax(dim=1, keepdim=True).clamp_min_(MIN_AMAX)
    best_scale = amax / INT8_MAX
    best_err = _row_codes_error(rows, best_scale, INT8_MAX)
    for ratio in _CLIP_RATIOS[1:]:
        scale = amax * (ratio / INT8_MAX)
        err = _row_codes_error(rows, scale, INT8_MAX)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    for _ in range(_LS_REFINE_STEPS):
        codes = torch.round(rows / best_scale).clamp_(-INT8_MAX, INT8_MAX)
        scale = (rows * codes).sum(dim=1, keepdim=True) / (codes * codes).sum(dim=1, keepdim=True).clamp_min(1.0)
        scale = torch.where(scale > 0, scale, best_scale)
        err = _row_codes_error(rows, scale, INT8_MAX)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale


@torch.no_grad()
def quantize_int8_weight(w: torch.Tensor, group_size: int | None = None,
                         clip_search: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of a weight w [N, K] -> (qweight int8 [N, K], scales float32).

    group_size=None: one scale per output channel, scales [N]. Otherwise one per `group_size`
    consecutive inputs of a row, scales [N, K // group_size] (K must be a multiple of group_size).
    Codes are round-to-nearest(w / scale) clamped to [-127, 127]; dequantized w ~= q * scale.

    clip_search=False: scale = absmax / 127, so |w - q * scale| <= scale / 2 everywhere.
    clip_search=True (default): per row (or group), scale chosen by `_search_int8_scales` to minimise
    the squared error (clipping a few outliers for a finer step); elements beyond 127 * scale then err
    by |w| - 127 * scale. Measured gain, rows of 4096 (512 rows): weight (= output-channel) MSE lower
    by 3.2% on Gaussian, 2.8% Laplace, 2.2% Student-t(3) rows per channel; with groups of 128 by
    4.1%, 2.7%, 1.2%. Small, since 8-bit absmax rounding is already near the optimum. It costs ~23
    quantize passes over the weight, once at load: 0.1 s for a 14336 x 4096 matrix on an H200, but
    ~0.3 us per weight on this 2-core CPU (4.7 s for 4096 x 4096; ~30 s for SmolLM2-135M's layers):
    pass clip_search=False where load time matters more than the last few percent of MSE.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_int8_weight: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_int8_weight: w must be floating point, got {w.dtype}")
    num_out, k = w.shape
    if k == 0:
        raise ValueError("quantize_int8_weight: w has no columns (K=0)")
    if group_size is not None and (group_size <= 0 or k % group_size):
        raise ValueError(f"quantize_int8_weight: group_size {group_size} must be positive and divide K={k}")
    cols = k if group_size is None else group_size
    rows = w.float().reshape(num_out * (k // cols), cols)
    if clip_search:
        chunk = max(_SEARCH_CHUNK_ELEMENTS // cols, 1)
        scales = torch.cat([_search_int8_scales(rows[i:i + chunk]) for i in range(0, rows.shape[0], chunk)])
    else:
        scales = rows.abs().amax(dim=1, keepdim=True).clamp_min_(MIN_AMAX) / INT8_MAX
    qweight = torch.round(rows / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).reshape(num_out, k)
    if group_size is None:
        return qweight, scales.reshape(num_out).contiguous()
    return qweight, scales.reshape(num_out, k // cols).contiguous()


def dequantize_int8_weight(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(qweight int8 [N, K], scales [N] or [N, G]) -> float32 [N, K]."""
    w = qweight.float()
    if scales.dim() == 1:
        return w * scales.float()[:, None]
    num_out, k = qweight.shape
    group_size = k // scales.shape[1]
    return (w.reshape(num_out, -1, group_size) * scales.float()[:, :, None]).reshape(num_out, k)



# ----------------------------------------------------------------------------------------------------
# Kernel, launch settings, wrapper, CPU path, reference
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _int8_linear_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SINGLE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INT8_BITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # Grid (M blocks, N blocks, K splits). Consecutive programs share an N block (its weight tile) and
    # differ in M, so at prefill a weight tile is fetched from HBM once and re-read from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Rows past M / N read a valid row instead (their results are never stored): no row masks in the loop.
    rows_x = (offs_m % M).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = (k + offs_k) < k_end
        x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        # int8 -> x's dtype in registers: exact, the weight is never dequantized in memory.
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0)
        if INT8_BITS:  # without I2F: see quant_common.INT8_BITS_ENV
            w = int8_to_float32(w)
        w = w.to(x.dtype)
        if GROUP_SIZE > 0:
            # BLOCK_K divides GROUP_SIZE and tiles start at multiples of BLOCK_K: one group per tile.
            s = tl.load(scales_ptr + rows_w * stride_sn + k // GROUP_SIZE)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GROUP_SIZE == 0:
        acc = acc * tl.load(scales_ptr + rows_w * stride_sn)[None, :]

    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if IS_SINGLE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_w).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # fp32 partial of this K slice, already scaled; sum_splits_kernel adds the bias
        tl.store(out_ptrs, acc, mask=out_mask)


class Int8LinearConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    int8_bits: bool = False  # the weight converted by integer ops, not I2F (`quant_common.int8_to_float32`)


def int8_launch_config(m: int, n: int, k: int, group_size: int, num_sms: int, *,
                       int8_bits: bool = False) -> Int8LinearConfig:
    """Launch settings of `_int8_linear_kernel` for x [m, k] and a weight [n, k].

    Decode (m <= 64) reads every weight byte once and does ~2m flops per byte: memory-bound, so the
    tiles keep many independent weight rows in flight on every SM:
    - BLOCK_M covers m in one block (16 = tl.dot's minimum, rows past m are never stored; 32; 64), so
      the weight is streamed exactly once.
    - BLOCK_K = 128 int8 = one 128-byte line per weight row per step, 16-byte loads per thread.
    - BLOCK_N = 128 weight rows per program for m <= 16, 64 above (the bf16 MMA work grows with m).
    - split-K: n / BLOCK_N programs is 32 at n=4096 for 132 SMs, so while there are fewer programs
      than SMs, K is divided until there are ~2 per SM (each split >= 512 inputs, at most 16 splits);
      a second small kernel sums the fp32 partials in a fixed order.
    Swept on an H200 (Triton 3.6, bf16 x, K=4096: N 4096, 6144, 28672, 128256; K=14336: N 4096; M 1,
    16, 64; BLOCK_N 32/64/128 x BLOCK_K 128/256 x split 1-8): these settings were best or within ~5%
    of the best (~10% at M=64) in every case. M <= 16 runs 1.2-1.7x faster than cuBLAS bf16 (e.g.
    N=K=4096: 10.1 us vs 13.5; 28672 x 4096: 35-41 us vs 57-61; lm_head 128256 x 4096: 147 us = 3.6
    TB/s of int8 vs 248); M=32 0.9-1.25x cuBLAS's speed; M=64 0.6-1.0x (the in-register
    dequantization and small-M MMAs cost more than the halved weight read saves).
    Prefill (m > 64) is compute-bound: 128 x 128 x 64 tiles, 4 warps, 4 stages (the best of the ~10
    tried), split-K only while the tiles fill less than half the SMs (m=128, n=4096: 22 us, cuBLAS
    14). It is not the fast path: 0.55-0.9x cuBLAS bf16 speed (m=512, n=k=4096: 50 us vs 28;
    m=4096: 291 us vs 201, n=28672: 2.03 ms vs 1.44); for big prefills dequantizing once to bf16 and
    calling cuBLAS is faster.
    Group-wise scales need each K tile inside one group: BLOCK_K is capped at the largest power of two
    dividing group_size (group_size must be a multiple of 16, tl.dot's minimum K).
    m <= 16 normally takes the small-M kernel instead (`small_m_launch_config`); these settings serve
    $TANDEM_QUANT_SMALL_M=0 and `small_m=False`.
    """
    if m <= 16:
        block_m, block_n, block_k, num_warps, num_stages = 16, 128, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, num_warps, num_stages = (32 if m <= 32 else 64), 64, 128, 4, 4
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 128, 64, 4, 4
    if group_size:
        block_k = min(block_k, largest_pow2_divisor(group_size, block_k))
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    # Prefill tiles are big: one wave of them that is at least half full beats the partials' traffic.
    if programs < (num_sms if m <= 64 else num_sms // 2):
        split_k = max(1, min(triton.cdiv(2 * num_sms, programs), k // 512, 16))
    return Int8LinearConfig(block_m, block_n, block_k, split_k, num_warps, num_stages, int8_bits)


# Large M: dequantize once, then cuBLAS. The int8 GEMM above runs at 0.55-0.9x cuBLAS bf16 (its docstring);
# writing the bf16 weight costs 3 bytes per weight (read 1, write 2), ~0.3 ms for an 8B layer stack's largest
# projection pair at H200 bandwidth, against a prompt step's GEMMs at M >= 512 of several ms.
INT8_DEQUANT_MIN_M_ENV = "TANDEM_INT8_DEQUANT_MIN_M"
INT8_DEQUANT_MIN_M_DEFAULT = 512


@functools.lru_cache(maxsize=1)
def int8_dequant_min_m() -> int:
    """The smallest M whose int8 linear dequantizes the weight to x's dtype and calls cuBLAS:
    $TANDEM_INT8_DEQUANT_MIN_M (0: never), else INT8_DEQUANT_MIN_M_DEFAULT. Read once (`cache_clear()` re-reads)."""
    raw = os.environ.get(INT8_DEQUANT_MIN_M_ENV, "").strip()
    if not raw:
        return INT8_DEQUANT_MIN_M_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${INT8_DEQUANT_MIN_M_ENV}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"${INT8_DEQUANT_MIN_M_ENV}={value} must be >= 0")
    return value


@triton.jit
def _int8_dequant_kernel(
    w_ptr, scales_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0).to(tl.float32)
    if GROUP_SIZE > 0:
        s = tl.load(scales_ptr + rows * stride_sn + (offs_k // GROUP_SIZE)[None, :], mask=mask, other=0.0)
    else:
        s = tl.load(scales_ptr + rows * stride_sn, mask=(offs_n < N)[:, None], other=0.0)
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int8_weight_triton(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(qweight int8 [N, K], scales float32 [N] or [N, K // group_size]) -> [N, K] in `dtype` (q * scale in fp32,
    rounded once to `dtype`). One launch; the result is a fresh tensor from the caching allocator."""
    check_launchable("int8_dequant", qweight, scales)
    check_last_dim_contiguous("int8_dequant", qweight=qweight, scales=scales)
    n, k = qweight.shape
    group_size = 0 if scales.dim() == 1 else k // scales.shape[1]
    out = torch.empty((n, k), device=qweight.device, dtype=dtype)
    if n == 0 or k == 0:
        return out
    block_n, block_k = 32, 256
    pdl = use_pdl(qweight.device)
    _int8_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, out, n, k, qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
    )
    return out


def int8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, *,
                       config: Int8LinearConfig | SmallMConfig | None = None, small_m: bool | None = None,
                       workspace: SmallMWorkspace | None = None) -> torch.Tensor:
    """Weight-only int8 linear: x [M, K] (fp32 / bf16 / fp16), qweight int8 [N, K], scales float32
    [N] or [N, K // group_size], bias [N] or None -> x @ dequant(qweight).T + bias, [M, N] in x.dtype.

    Accumulates in fp32. Group-wise scales need group_size to be a multiple of 16. Small M (`use_small_m`:
    M <= $TANDEM_QUANT_SMALL_M, by default M = 1 for int8; `small_m` True / False forces it on /
    off) runs `small_m_linear_triton`; M >= `int8_dequant_min_m()` (prompt steps) dequantizes the weight to x's
    dtype (`dequantize_int8_weight_triton`) and calls cuBLAS; other M `_int8_linear_kernel`. `config` overrides the
    launch settings and picks the kernel by its type (`small_m_launch_config` / `int8_launch_config`: pure
    functions of the shapes, so a CUDA graph fixes them at capture); `workspace`: see `small_m_linear_triton`.
    """
    if isinstance(config, SmallMConfig) or (config is None and use_small_m(x.shape[0] if x.dim() == 2 else 0,
                                                                           small_m, "int8")):
        return small_m_linear_triton(x, qweight, scales, bias, config=config, workspace=workspace)
    check_launchable("int8_linear", x, qweight, scales)
    check_last_dim_contiguous("int8_linear", x=x, qweight=qweight, scales=scales)
    group_size = check_linear_args("int8_linear", x, qweight, scales, bias, torch.int8, allow_groups=True)
    dequant_min_m = int8_dequant_min_m()
    if config is None and dequant_min_m and x.shape[0] >= dequant_min_m:
        return torch.nn.functional.linear(x, dequantize_int8_weight_triton(qweight, scales, x.dtype),
                                          None if bias is None else bias.to(x.dtype))
    if group_size % 16:
        raise ValueError(f"int8_linear: group size {group_size} (from scales {tuple(scales.shape)}) "
                         f"must be a multiple of 16")
    if bias is not None:
        check_last_dim_contiguous("int8_linear", bias=bias)
    m, k = x.shape
    n = qweight.shape[0]
    out = x.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    cfg = config if isinstance(config, Int8LinearConfig) else int8_launch_config(
        m, n, k, group_size, num_sms(x.device), int8_bits=int8_bits_default())
    if cfg.split_k < 1 or (group_size and group_size % cfg.block_k):
        raise ValueError(f"int8_linear: config {cfg} invalid (split_k >= 1, block_k must divide the group size)")
    # Each split covers a whole number of K tiles, so (per group) a tile never straddles two groups.
    k_per_split = max(triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k, cfg.block_k)
    split_k = max(triton.cdiv(k, k_per_split), 1)
    is_single_split = split_k == 1
    # Scratch from the caching allocator (a graph's private pool under capture): no host sync.
    target = out if is_single_split else torch.empty((split_k, m, n), device=x.device, dtype=torch.float32)
    bias_arg = bias if bias is not None else scales  # never read when HAS_BIAS is False
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    pdl = use_pdl(x.device)
    _int8_linear_kernel[grid](
        x, qweight, scales, bias_arg, target,
        m, n, k, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0),
        0 if is_single_split else target.stride(0), target.stride(-2),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, IS_SINGLE_SPLIT=is_single_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(x.dtype), INT8_BITS=cfg.int8_bits,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not is_single_split:
        block_n = 256
        sum_splits_kernel[(m, triton.cdiv(n, block_n))](
            target, bias_arg, out, n, split_k, target.stride(0), target.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_S=triton.next_power_of_2(split_k), BLOCK_N=block_n,
            USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
        )
    return out


# `torch._weight_int8pack_mm`'s bf16 kernel on AVX2 steps through K in vectors: with K not a multiple of
# 16 it returns garbage or crashes (checked in torch 2.13: K=40 gave NaN, K=56 and 100 segfaulted;
# every multiple of 16 up to 1024 was right). Other K take its scalar fp32 kernel: right, but slow.
_INT8PACK_BF16_K_MULTIPLE = 16


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Ones [n] for `torch._weight_int8pack_mm`: the fp32 scales are applied after it, in fp32."""
    return torch.ones(n, dtype=dtype)


def _int8pack_mm_unscaled(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (CPU, any float) @ qweight int8 [N, K] (contiguous).T, unscaled, in bf16 (K a multiple
    of 16) or fp32 (the op's slow exact kernel, any K)."""
    dtype = torch.bfloat16 if x.shape[1] % _INT8PACK_BF16_K_MULTIPLE == 0 else torch.float32
    return torch._weight_int8pack_mm(x.to(dtype), qweight, _unit_scales(qweight.shape[0], dtype))


def int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int8 linear on the CPU through `torch._weight_int8pack_mm`; same contract as
    `int8_linear_ref`. The weight stays int8 in memory (no per-call dequantization).

    The op is fast only for bfloat16 activations (see the module docstring): x is cast to bf16 (its
    rounding, ~0.2% relative, is the main cost in accuracy), multiplied with unit scales, and the fp32
    scales and bias are applied to the [M, N] result in fp32 before the cast to x.dtype. The bf16
    kernel needs K (per group: group_size) to be a multiple of 16; other sizes run the op's fp32
    kernel (exact, 10-30x slower). Group-wise scales run one op call per group on contiguous copies
    of the group's columns of x and of the int8 weight (made per call): correct but slow; quantize
    per channel for the CPU.
    """
    group_size = check_linear_args("int8_linear_cpu", x, qweight, scales, bias, torch.int8, allow_groups=True)
    if x.device.type != "cpu":
        raise ValueError(f"int8_linear_cpu: x must be a CPU tensor, got {x.device}")
    if not qweight.is_contiguous():
        raise ValueError(f"int8_linear_cpu: qweight must be contiguous, strides {qweight.stride()}")
    n, k = qweight.shape
    # Each torch call costs ~4 us of dispatch on this CPU, as much as a small layer's product: three
    # calls per channel-wise linear (cast, op, scale with bias; the final cast is free for fp32 x).
    if group_size == 0:
        part = _int8pack_mm_unscaled(x, qweight)
        # bf16 (or fp32) part times fp32 scales promotes to fp32: scaled and widened in one op.
        out = torch.mul(part, scales) if bias is None else torch.addcmul(bias.float(), part, scales)
        return out.to(x.dtype)
    num_groups = k // group_size
    grouped = qweight.view(n, num_groups, group_size).transpose(0, 1).contiguous()  # [G, N, gs]
    out = torch.zeros((x.shape[0], n), dtype=torch.float32) if bias is None else \
        bias.float().expand(x.shape[0], n).clone()
    for g in range(num_groups):
        part = _int8pack_mm_unscaled(x[:, g * group_size:(g + 1) * group_size], grouped[g])
        out.addcmul_(part, scales[:, g])
    return out.to(x.dtype)


def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], qweight int8 [N, K], scales float32 [N] or [N, G], bias [N] or None -> [M, N] in x.dtype.

    Dequantizes the whole weight to fp32 and multiplies in fp32 (any device).
    """
    check_linear_args("int8_linear", x, qweight, scales, bias, torch.int8, allow_groups=True)
    out = x.float() @ dequantize_int8_weight(qweight, scales).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


"""Small M (decode): a weight-only GEMV / skinny GEMM for int8 and fp8 weights, chosen by `quant_linear`'s
`int8_linear_triton` and `fp8_linear_triton` at small M (`use_small_m`). Why the large-M GEMMs fall short there,
and the design, below."""

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
    FP8_DTYPE,
    SMALL_M_INT8_BITS_DEFAULT,
    check_linear_args,
    int8_bits_default,
    int8_to_float32,
    largest_pow2_divisor,
    num_sms,
    sum_splits_kernel,
)

# Why `quant_linear`'s GEMMs reach only ~half of HBM bandwidth at decode (M = 1 .. 16), from their launch settings
# (8B shapes, 132 SMs; `int8_launch_config` at m <= 16: 16 x 128 x 128 tiles, 4 warps, 4 stages):
#   1. Two launches for three of the four projections: qkv (48 N tiles -> split 6), o (32 -> split 8) and
#      down (32 -> split 9) write fp32 partials and run `sum_splits_kernel` after. In a CUDA graph each
#      kernel boundary costs a drain + ramp (~1.5-3 us) against floors of 3.9 (o), 5.9 (qkv) and 13.8 us
#      (down): the measured 10.1 us for 4096 x 4096 is 39% of its 3.95 us floor.
#   2. Wave imbalance where it does not split: gate_up has 224 programs of 128 rows for 132 SMs, so 92 SMs
#      stream two tiles and 40 stream one (35-41 us against a 27.6 us floor).
#   3. tl.dot's minimum BLOCK_M of 16 pads M = 1 to 16 rows: 16x the MMA work and x-tile traffic, and the
#      weight (the B operand, [BLOCK_K, BLOCK_N] after tl.trans) goes through shared memory and the
#      dot-operand layout conversion; at M = 1 the multiply-add on the CUDA cores needs none of that.
#   4. fp8 at small M quantizes the activations in a second kernel (one more launch per projection) and
#      then runs the 16 x 64 fp8-MMA GEMM, whose 64-row tiles give 64 programs at N = 4096 and no split-K:
#      half the SMs idle for o and down, so the halved weight bytes bought nothing (5.21 ms vs bf16 5.16).
# (Scales are not the cause: per channel they are read once in the epilogue; per group once per K tile.)
#
# The path here, chosen by M (`small_m_settings`), for both weight kinds:
#   - weight-only: the int8 or e4m3 tile is loaded as stored (1 byte per weight, 16-byte vector loads along
#     K), converted in registers and multiplied with the activations as given (bf16 / fp16 / fp32), fp32
#     accumulation, the per-channel scale once in the epilogue (per group: once per K tile). fp8 skips the
#     per-token activation quantization: one launch fewer, and no activation rounding (~2-3% relative error
#     of e4m3 gone), so its numerics are at least as good as the W8A8 path's.
#   - two inner products: M = 1 (up to `fma_max_m`) on the CUDA cores, an fp32 [BLOCK_N, BLOCK_K] accumulator
#     updated with one FMA per weight and reduced across K once after the loop (no per-step shuffles);
#     larger M on the tensor cores with the operands swapped: out^T [BLOCK_N, 16] = W [BLOCK_N, K] @ x^T, so
#     the weight is tl.dot's A operand (64 rows, Hopper's MMA M) and only the small activation tile is padded
#     to 16.
#   - split-K sized so that the grid holds ~`programs_per_sm` programs per SM (small tiles: many resident per
#     SM, enough bytes in flight without relying on the pipeliner, and no wave tail), the partial sums reduced
#     in the same launch: each program stores its fp32 partial, a CTA barrier, one acq_rel atomic increment of
#     its N tile's counter; the program that arrives last sums the partials in split order (deterministic:
#     which one is last does not change the result), adds the bias, stores, and resets the counter to zero, so
#     the counters stay zero between launches and a CUDA graph replays with no memset. The counters are a
#     per-layer workspace (`SmallMWorkspace`) made outside graph capture; without one (or with
#     fused_reduce=False) the partials go through `sum_splits_kernel` as before.

SMALL_M_LIMIT = 16  # the largest M the small-M kernel takes (its tensor-core tile pads M to 16)
_MAX_SPLIT_K = 32
SMALL_M_ENV = "TANDEM_QUANT_SMALL_M"  # max M of the small-M path; 0 turns it off (default: SMALL_M_DEFAULT_MAX_M)
FMA_MAX_M_ENV = "TANDEM_QUANT_FMA_MAX_M"  # max M of its CUDA-core variant; larger M use the tensor cores (default 1)
FUSED_REDUCE_ENV = "TANDEM_QUANT_FUSED_REDUCE"  # 0: split-K partials summed by a second kernel (default 1)
PROGRAMS_PER_SM_ENV = "TANDEM_QUANT_PROGRAMS_PER_SM"  # split-K target; default 4 (CUDA cores) / 2 (tensor cores)
X_TILE_ENV = "TANDEM_QUANT_X_TILE"  # 0: M = 1's activations loaded as a row, not in the weight tile's layout
M1_BLOCK_N_ENV = "TANDEM_QUANT_M1_BLOCK_N"  # weight rows per program of the M = 1 GEMV (default M1_BLOCK_N)
# The M = 1 GEMV's tile: 16 weight rows x 256 inputs, 4 warps (each thread one 16-byte load per row, 32 fp32
# products). Swept on an H100 (`quant_gemv --sweep --kinds int8,fp8 --m 1`, benchmarks/results/h100-2026-12-07d/
# 2-gemv18-serve14b): llama-3.1-8b's four projections per layer 92.0 us (int8) / 90.2 us (fp8) against 98.7 / 95.0
# with the earlier 32 rows; 16 rows make twice the N tiles, so the small projections (qkv, o, down) fill the SMs with
# fewer K splits. The 8B decode step at batch 1 with this tile and x_tile against 32 rows without it, twice
# (3-v18): int8 3.876 / 3.887 against 4.104 / 4.106 ms, fp8 3.804 / 3.800 against 3.979 / 3.969.
M1_BLOCK_N = 16
M1_BLOCK_K = 256


# The largest M that takes the small-M path by default, per kind. fp8, as measured on an H200 (llama-3.1-8b's four
# projections per layer, `benchmarks/results/h200-2026-12-01/quant-gemv.json`): at M=1 78.7 us against the W8A8
# path's 129.6 (a decode step 5.27 -> 3.64 ms), at M=4 and 16 even (114 vs 116, 115 vs 115). int8 at M=1 only, with
# the integer-op conversion (SMALL_M_INT8_BITS_DEFAULT): the 8B decode step at batch 1 on an H100 4.25 / 4.26 ms
# against the GEMM's 4.51 / 4.46 (two sessions; the GEMV with I2F was not faster, 4.51 / 4.52); at M=4 and 16 the
# GEMM wins (H200 GEMV sums 78.7 / 79.9 us against 103.7 / 103.5).
SMALL_M_DEFAULT_MAX_M = {"fp8": 4, "int8": 1}


class SmallMSettings(NamedTuple):
    max_m: int | None = None  # None: SMALL_M_DEFAULT_MAX_M of the layer's kind
    fma_max_m: int = 1
    fused_reduce: bool = True
    programs_per_sm: int | None = None  # None: the config's default per variant
    x_tile: bool = True
    m1_block_n: int = M1_BLOCK_N


def _env_int(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"${name}={value} must lie in [{low}, {high}]")
    return value


@functools.lru_cache(maxsize=1)
def small_m_settings() -> SmallMSettings:
    """The small-M path's switches, read once from the environment (`small_m_settings.cache_clear()` re-reads:
    the benchmarks flip them in one process). $TANDEM_QUANT_SMALL_M: the largest M that takes it (0: never;
    default SMALL_M_DEFAULT_MAX_M by kind); $TANDEM_QUANT_FMA_MAX_M: the largest M on the CUDA cores (0: always
    tensor cores, default 1); $TANDEM_QUANT_FUSED_REDUCE=0: a second kernel sums the split-K partials;
    $TANDEM_QUANT_PROGRAMS_PER_SM: the split-K target; $TANDEM_QUANT_X_TILE=0: M = 1's activations loaded as a row;
    $TANDEM_QUANT_M1_BLOCK_N: the M = 1 GEMV's weight rows per program (16, 32 or 64). A CUDA graph keeps the path
    it was captured with."""
    per_sm = _env_int(PROGRAMS_PER_SM_ENV, 0, 0, 64)
    max_m = _env_int(SMALL_M_ENV, -1, 0, SMALL_M_LIMIT)
    return SmallMSettings(max_m=None if max_m < 0 else max_m,
                          fma_max_m=_env_int(FMA_MAX_M_ENV, 1, 0, SMALL_M_LIMIT),
                          fused_reduce=_env_int(FUSED_REDUCE_ENV, 1, 0, 1) == 1,
                          programs_per_sm=per_sm or None,
                          x_tile=_env_int(X_TILE_ENV, 1, 0, 1) == 1,
                          m1_block_n=_m1_block_n())


def _m1_block_n() -> int:
    value = _env_int(M1_BLOCK_N_ENV, M1_BLOCK_N, 16, 64)
    if value not in (16, 32, 64):
        raise ValueError(f"${M1_BLOCK_N_ENV}={value} must be 16, 32 or 64")
    return value


def use_small_m(m: int, small_m: bool | None = None, kind: str = "fp8") -> bool:
    """Whether an [m, K] input of a `kind` ("int8" | "fp8") layer takes the small-M path: `small_m` forces it
    (True: up to SMALL_M_LIMIT) or the old path (False); None follows `small_m_settings()`, else the kind's
    measured default (SMALL_M_DEFAULT_MAX_M)."""
    if small_m is False:
        return False
    if small_m:
        limit = SMALL_M_LIMIT
    else:
        configured = small_m_settings().max_m
        limit = SMALL_M_DEFAULT_MAX_M[kind] if configured is None else configured
    return 0 < m <= limit


class SmallMConfig(NamedTuple):
    use_dot: bool  # tensor cores (swapped operands, M padded to 16) instead of CUDA-core FMAs
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # the number of K slices actually launched (each a whole number of BLOCK_K tiles)
    num_warps: int
    num_stages: int
    fused_reduce: bool  # split-K partials summed by the last program of each N tile (else a second kernel)
    int8_bits: bool = False  # int8 weights converted by integer ops, not I2F (`quant_common.int8_to_float32`)
    # M = 1 on the CUDA cores: the activations loaded as a [BLOCK_N, BLOCK_K] tile whose rows are alike, in the
    # weight tile's layout, rather than as one [BLOCK_K] row that the compiler re-lays out through shared memory
    # every K step (four CTA barriers per step in the sm_90 PTX; none this way, at the price of L1-served repeat
    # loads). The same products; the same bits in the interpreter, not always on hardware (the compiler may reduce
    # the tile in another order: last bits on an H100 for K = 40). On by default (`small_m_settings`,
    # $TANDEM_QUANT_X_TILE): an H100's 8B decode step at batch 1, off / on twice, int8 4.176 / 4.151 and
    # 4.174 / 4.150 ms, fp8 4.037 / 4.017 and 4.042 / 4.013 (benchmarks/results/h100-2026-12-07d/1-next18).
    x_tile: bool = False


def small_m_k_per_split(k: int, block_k: int, split_k: int) -> int:
    """Inputs per K slice: whole BLOCK_K tiles, so a tile never straddles two slices (nor, per group, two
    groups); `cdiv(k, result)` slices cover K."""
    return max(triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k, block_k)


def small_m_launch_config(m: int, n: int, k: int, group_size: int, num_sms: int, *,
                          fma_max_m: int = 1, programs_per_sm: int | None = None,
                          fused_reduce: bool = True, int8_bits: bool = False, x_tile: bool = False,
                          m1_block_n: int = M1_BLOCK_N) -> SmallMConfig:
    """Launch settings of `_small_m_linear_kernel` for x [m, k] (1 <= m <= 16) and a weight [n, k] of int8 or
    fp8 (the same for both: one byte per weight). A pure function of its arguments.

    - m <= fma_max_m: CUDA cores. m = 1: a 1 x m1_block_n x 256 tile (M1_BLOCK_N, swept; each thread one
      16-byte load of 16 weights per row). Above: BLOCK_M = next power of two >= m, the [BLOCK_M, BLOCK_N,
      BLOCK_K] product tile kept at 8,192 elements (64 fp32 per thread at 4 warps), 16 rows and a K tile of
      8,192 / (16 * BLOCK_M). 4 programs per SM by default.
    - else tensor cores: 16 x 64 x 128 (BLOCK_M 16 = tl.dot's minimum; 64 weight rows = the MMA's M), 4 warps,
      4 stages, 2 programs per SM by default.
    - split-K: while cdiv(n, BLOCK_N) < programs_per_sm * num_sms, K is divided to reach that many programs,
      each slice at least two K tiles, at most 32 slices. 8B shapes at M = 1, 132 SMs: qkv 6144 -> 384 x 2,
      o 4096 -> 256 x 3, gate_up 28672 -> 1792 x 1, down 4096 rows -> 256 x 3.
    Group-wise scales need each K tile inside one group: BLOCK_K is capped at the largest power of two
    dividing group_size. The defaults are reasoned, not swept: `python -m tandem.benchmarks.quant_gemv`
    times the alternatives.
    """
    if not 1 <= m <= SMALL_M_LIMIT:
        raise ValueError(f"small_m_launch_config: m={m} outside [1, {SMALL_M_LIMIT}]")
    if n < 1 or k < 1 or num_sms < 1:
        raise ValueError(f"small_m_launch_config: n={n}, k={k}, num_sms={num_sms} must be positive")
    use_dot = m > fma_max_m
    if use_dot:
        block_m, block_n, block_k, num_warps, num_stages = 16, 64, 128, 4, 4
        per_sm = programs_per_sm or 2
    else:
        block_m = triton.next_power_of_2(m)
        if block_m == 1:
            block_n, block_k = m1_block_n, M1_BLOCK_K
        else:
            block_n = 16
            block_k = 8192 // (block_m * block_n)
        num_warps, num_stages = 4, 3
        per_sm = programs_per_sm or 4
    if group_size:
        block_k = min(block_k, largest_pow2_divisor(group_size, block_k))
    tiles_n = triton.cdiv(n, block_n)
    split_k = 1
    target = per_sm * num_sms
    if tiles_n < target:
        split_k = max(1, min(triton.cdiv(target, tiles_n), k // (2 * block_k), _MAX_SPLIT_K))
    split_k = triton.cdiv(k, small_m_k_per_split(k, block_k, split_k))  # the slices actually launched
    return SmallMConfig(use_dot, block_m, block_n, block_k, split_k, num_warps, num_stages,
                        fused_reduce and split_k > 1, int8_bits, x_tile and not use_dot and block_m == 1)


class SmallMWorkspace:
    """Split-K counters of one layer for the fused reduce: int32, zero between launches (the last program of
    each N tile resets its own). Allocated at the first call outside CUDA graph capture (a graph's pool must
    not own it); `counters(device, tiles)` returns None where it cannot: the caller then reduces with the
    second kernel."""

    def __init__(self) -> None:
        self._counters: torch.Tensor | None = None
        # Every tensor handed out stays alive: a captured graph may still point at one that was outgrown.
        self._history: list[torch.Tensor] = []

    def counters(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        c = self._counters
        if c is not None and c.device == device and c.numel() >= tiles:
            return c
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        self._counters = torch.zeros(max(tiles, 64), dtype=torch.int32, device=device)
        self._history.append(self._counters)
        return self._counters


@triton.jit
def _add_residual(x_ptr, res_ptr, cols, mask):
    """x + residual at `cols` of row 0, rounded to x's dtype as HF adds them (in the model dtype), as fp32."""
    h = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return h.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _row_rstd(x_ptr, res_ptr, K, eps, offs_k, ADD: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(h^2) + eps) of row 0's h = x (+ residual with ADD), over all K: every program of a fused
    norm + linear computes it for itself (the row is 2-4 bytes x K, read from L2), so no launch comes between the
    norm and the projection."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        if ADD:
            h = _add_residual(x_ptr, res_ptr, cols, cols < K)
        else:
            h = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        squares += h * h
    return tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _normed_tile(x_ptr, res_ptr, norm_w_ptr, new_res_ptr, cols, k_end, rstd, store_residual, ADD: tl.constexpr):
    """Row 0's normalized activations at `cols` (as `kernels.rms_norm` rounds them: to x's dtype before and after
    the weight), with ADD the residual added first and the sum stored as the new residual at the columns below
    `store_residual` (K in the first N tile's programs, 0 elsewhere: one program writes each column)."""
    mask = cols < k_end
    if ADD:
        h = _add_residual(x_ptr, res_ptr, cols, mask)
        tl.store(new_res_ptr + cols, h.to(new_res_ptr.dtype.element_ty), mask=mask & (cols < store_residual))
    else:
        h = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (normed * weight).to(x_ptr.dtype.element_ty)


@triton.jit
def _silu_mul_tile(x_ptr, cols, k_end, K):
    """silu(gate) * up at `cols` of row 0 of a gate_up row [gate (K) | up (K)], rounded as `silu_and_mul` rounds
    it (silu to x's dtype before the product, the product to x's dtype)."""
    mask = cols < k_end
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    return (silu * up).to(x_ptr.dtype.element_ty)


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr,
    M, N, K, k_per_split, num_splits,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SINGLE_SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, W_FP8: tl.constexpr, INT8_BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    res_ptr, norm_w_ptr, new_res_ptr, eps, NORM: tl.constexpr, SILU_MUL: tl.constexpr, X_TILE: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # Grid (N tiles, K slices); one M tile holds every row (M <= BLOCK_M). Rows past M / N read a valid row
    # instead (their results are never stored): no row masks in the loop. EVEN_K: every slice is whole K tiles.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if NORM > 0:  # M = 1 on the CUDA cores: the row's RMS over all of K (L2-resident), before this slice's loop
        rstd = _row_rstd(x_ptr, res_ptr, K, eps, offs_k, NORM == 2, BLOCK_K)
    rows_x = (offs_m % M).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_row_ptrs = x_ptr + k_start + offs_k  # BLOCK_M == 1: row 0

    if USE_DOT:  # out^T tile [BLOCK_N, BLOCK_M]: the weight is the MMA's A operand
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1 and GROUP_SIZE == 0:  # per-lane partial sums, reduced across K after the loop
        acc_k = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            k_mask = (k + offs_k) < k_end
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0)
        if W_FP8:  # read as bytes (masked lanes 0 = +0.0), reinterpreted as e4m3
            w = w.to(tl.float8e4nv, bitcast=True)
        elif INT8_BITS:  # int8 -> fp32 without I2F (masked lanes 0 -> 0.0); the .to() below are then no-ops
            w = int8_to_float32(w)
        if SILU_MUL:  # the activation row is silu(gate) * up of the gate_up row x_ptr points to: made here
            x = _silu_mul_tile(x_ptr, k + offs_k, k_end, K)
        elif NORM > 0:  # the activation row normalized here (and the new residual stored by the first N tile)
            x = _normed_tile(x_ptr, res_ptr, norm_w_ptr, new_res_ptr, k + offs_k, k_end, rstd,
                             tl.where(pid_n == 0, K, 0), NORM == 2)
        elif X_TILE:  # the row as a [BLOCK_N, BLOCK_K] tile of equal rows, in the weight tile's layout
            if EVEN_K:
                x = tl.load(x_row_ptrs[None, :] + 0 * offs_n[:, None])
            else:
                x = tl.load(x_row_ptrs[None, :] + 0 * offs_n[:, None], mask=k_mask[None, :], other=0.0)
        elif BLOCK_M == 1 and not USE_DOT:  # one activation row, [BLOCK_K]
            if EVEN_K:
                x = tl.load(x_row_ptrs)
            else:
                x = tl.load(x_row_ptrs, mask=k_mask, other=0.0)
        else:
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        if USE_DOT:
            # int8 -> x's dtype is exact; e4m3 -> bf16 / fp16 / fp32 too (bf16 has e4m3's range and more bits).
            part = tl.dot(w.to(x.dtype), tl.trans(x), input_precision=DOT_PRECISION)
            if GROUP_SIZE > 0:
                acc += part * tl.load(scales_ptr + rows_w * stride_sn + k // GROUP_SIZE)[:, None]
            else:
                acc += part
        elif BLOCK_M == 1 and GROUP_SIZE == 0:
            if X_TILE:
                acc_k += w.to(tl.float32) * x.to(tl.float32)
            else:
                acc_k += w.to(tl.float32) * x.to(tl.float32)[None, :]
        elif BLOCK_M == 1:
            if X_TILE:
                part = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)  # [BN]
            else:
                part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BN]
            acc += (part * tl.load(scales_ptr + rows_w * stride_sn + k // GROUP_SIZE))[None, :]
        else:
            part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [BM, BN]
            if GROUP_SIZE > 0:
                part = part * tl.load(scales_ptr + rows_w * stride_sn + k // GROUP_SIZE)[None, :]
            acc += part
        x_ptrs += BLOCK_K
        x_row_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if USE_DOT:
        tile_m = offs_m[None, :]
        tile_n = offs_n[:, None]
        rows_w_tile = rows_w[:, None]
    else:
        if BLOCK_M == 1 and GROUP_SIZE == 0:
            acc = tl.sum(acc_k, axis=1)[None, :]
        tile_m = offs_m[:, None]
        tile_n = offs_n[None, :]
        rows_w_tile = rows_w[None, :]
    if GROUP_SIZE == 0:
        acc = acc * tl.load(scales_ptr + rows_w_tile * stride_sn)
    out_mask = (tile_m < M) & (tile_n < N)
    out_ptrs = out_ptr + tile_m * stride_om + tile_n
    if IS_SINGLE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_w_tile).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [num_splits, M, N], fp32, already scaled.
        partial_ptrs = partial_ptr + tile_m * N + tile_n
        tl.store(partial_ptrs + pid_k * M * N, acc, mask=out_mask)
        if FUSED_REDUCE:
            # Every thread's partial is issued before one thread's release (the barrier orders them, the
            # release is cumulative); the last arrival's acquire makes all of them visible to its loads,
            # which bypass L1 (.cg).
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                total = tl.zeros_like(acc)
                for s in range(0, num_splits):  # split order: the same sum whichever program is last
                    total += tl.load(partial_ptrs + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + rows_w_tile).to(tl.float32)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(counters_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def small_m_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None, *, config: SmallMConfig | None = None,
                          workspace: SmallMWorkspace | None = None) -> torch.Tensor:
    """Weight-only linear for small M, int8 or float8_e4m3fn weights: x [M, K] (fp32 / bf16 / fp16, 1 <= M
    <= 16), qweight [N, K], scales float32 [N] (int8 also [N, K // group_size]), bias [N] or None ->
    x @ (qweight * scales).T + bias, [M, N] in x.dtype, fp32 accumulation. fp8 activations are not quantized.

    `config` overrides `small_m_launch_config` (whose switches come from `small_m_settings()`); `workspace`
    holds the split-K counters of the fused reduce (without one, a module-wide workspace outside graph
    capture; under capture the second-kernel reduce).
    """
    return _small_m_launch(x, qweight, scales, bias, config, workspace, None)


class _Norm(NamedTuple):
    """The RMSNorm a fused launch applies to its input row first (`small_m_add_norm_linear_triton`)."""
    residual: torch.Tensor | None  # [1, K], added first; None: the input alone is normalized
    weight: torch.Tensor  # [K]
    eps: float
    new_residual: torch.Tensor  # [1, K]: input + residual (unused without a residual)


def small_m_add_norm_linear_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                   eps: float, qweight: torch.Tensor, scales: torch.Tensor,
                                   bias: torch.Tensor | None = None, *, config: SmallMConfig | None = None,
                                   workspace: SmallMWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's RMSNorm (after the residual add, when `residual` is given) and the small-M linear in one launch:
    x, residual [1, K] -> (linear(rms_norm(x + residual)) [1, N], x + residual [1, K]); without a residual
    (linear(rms_norm(x)), x). The same arithmetic as `fused_add_rms_norm` (or `rms_norm`) then
    `small_m_linear_triton`, with the row's mean square summed in another order (fp32). x and residual are left
    untouched (every program reads them); the new residual is a new tensor. M = 1 on the CUDA cores only (the
    config's `use_dot` must be False)."""
    op = "add_norm_linear"
    check_launchable(op, x, norm_weight)
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"{op}: x must be one row [1, K], got shape {tuple(x.shape)}")
    check_last_dim_contiguous(op, x=x, norm_weight=norm_weight)
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"{op}: norm_weight shape {tuple(norm_weight.shape)} != ({x.shape[1]},)")
    if residual is not None:
        check_last_dim_contiguous(op, residual=residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"{op}: residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
    new_residual = x if residual is None else torch.empty_like(x)
    out = _small_m_launch(x, qweight, scales, bias, config, workspace, _Norm(residual, norm_weight, eps, new_residual))
    return out, new_residual


def small_m_silu_linear_triton(gate_up: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                               bias: torch.Tensor | None = None, *, config: SmallMConfig | None = None,
                               workspace: SmallMWorkspace | None = None) -> torch.Tensor:
    """One token's SwiGLU activation and the small-M linear in one launch: gate_up [1, 2K] (gate | up) ->
    linear(silu(gate) * up) [1, N], the same arithmetic as `silu_and_mul` then `small_m_linear_triton`. Every
    program makes its own K slice of the activation (no full-row pass, unlike the fused norm). M = 1 on the CUDA
    cores only."""
    op = "silu_linear"
    check_launchable(op, gate_up)
    if gate_up.dim() != 2 or gate_up.shape[0] != 1 or gate_up.shape[1] != 2 * qweight.shape[-1]:
        raise ValueError(f"{op}: gate_up must be one row [1, 2K] with K={qweight.shape[-1]} (qweight's inputs), got "
                         f"shape {tuple(gate_up.shape)}")
    check_last_dim_contiguous(op, gate_up=gate_up)
    return _small_m_launch(gate_up[:, : qweight.shape[-1]], qweight, scales, bias, config, workspace, None,
                           silu_mul=True)


def _small_m_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                    config: SmallMConfig | None, workspace: SmallMWorkspace | None, norm: _Norm | None,
                    silu_mul: bool = False) -> torch.Tensor:
    is_fp8 = qweight.dtype == FP8_DTYPE
    op = "fp8_linear" if is_fp8 else "int8_linear"
    check_launchable(op, x, qweight, scales)
    check_last_dim_contiguous(op, x=x, qweight=qweight, scales=scales)
    group_size = check_linear_args(op, x, qweight, scales, bias, FP8_DTYPE if is_fp8 else torch.int8,
                                    allow_groups=not is_fp8)
    if group_size % 16:
        raise ValueError(f"{op}: group size {group_size} (from scales {tuple(scales.shape)}) must be a multiple of 16")
    if bias is not None:
        check_last_dim_contiguous(op, bias=bias)
    m, k = x.shape
    n = qweight.shape[0]
    if m > SMALL_M_LIMIT:
        raise ValueError(f"{op}: the small-M kernel takes M <= {SMALL_M_LIMIT}, got {m}")
    out = x.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    if config is None:
        settings = small_m_settings()
        # A fused input (norm, SwiGLU) needs the CUDA-core variant: M = 1 takes it whatever $TANDEM_QUANT_FMA_MAX_M
        # says.
        config = small_m_launch_config(m, n, k, group_size, num_sms(x.device),
                                       fma_max_m=max(settings.fma_max_m, 1 if norm or silu_mul else 0),
                                       programs_per_sm=settings.programs_per_sm, fused_reduce=settings.fused_reduce,
                                       int8_bits=int8_bits_default(SMALL_M_INT8_BITS_DEFAULT),
                                       x_tile=settings.x_tile, m1_block_n=settings.m1_block_n)
    cfg = config
    if cfg.block_m < m or cfg.split_k < 1 or (cfg.use_dot and cfg.block_m < 16) \
            or (group_size and group_size % cfg.block_k):
        raise ValueError(f"{op}: config {cfg} invalid for M={m} (block_m >= M, 16 with use_dot; split_k >= 1; "
                         f"block_k must divide the group size)")
    if (norm is not None or silu_mul or cfg.x_tile) and (cfg.use_dot or cfg.block_m != 1):
        name = "silu_linear" if silu_mul else "add_norm_linear" if norm is not None else op
        raise ValueError(f"{name}: config {cfg} invalid: a fused input or x_tile runs on the CUDA cores at M = 1 "
                         f"(use_dot False, block_m 1)")
    k_per_split = small_m_k_per_split(k, cfg.block_k, cfg.split_k)
    split_k = triton.cdiv(k, k_per_split)
    is_single_split = split_k == 1
    tiles_n = triton.cdiv(n, cfg.block_n)
    counters = None
    if not is_single_split and cfg.fused_reduce:
        # Sized for BLOCK_N >= 16 (every default config) at the first call, so later M reuse it under capture.
        counters = (workspace or _default_workspace(x.device)).counters(x.device, max(tiles_n, triton.cdiv(n, 16)))
    fused = counters is not None
    # Scratch from the caching allocator (a graph's private pool under capture): no host sync.
    partial = scales if is_single_split else torch.empty((split_k, m, n), device=x.device, dtype=torch.float32)
    bias_arg = bias if bias is not None else scales  # never read when HAS_BIAS is False
    w_arg = qweight.view(torch.uint8) if is_fp8 else qweight  # fp8 read as bytes: masked lanes load 0 = +0.0
    # Without a norm (or without its residual) these are never read: any tensor stands in.
    residual = norm.residual if norm is not None and norm.residual is not None else x
    norm_kind = 0 if norm is None else (1 if norm.residual is None else 2)
    pdl = use_pdl(x.device)
    _small_m_linear_kernel[(tiles_n, split_k)](
        x, w_arg, scales, bias_arg, out, partial, counters if fused else scales,
        m, n, k, k_per_split, split_k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, IS_SINGLE_SPLIT=is_single_split, FUSED_REDUCE=fused,
        USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0, W_FP8=is_fp8, INT8_BITS=cfg.int8_bits and not is_fp8,
        DOT_PRECISION=dot_precision(x.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_PDL=pdl, res_ptr=residual, norm_w_ptr=x if norm is None else norm.weight,
        new_res_ptr=x if norm is None else norm.new_residual, eps=0.0 if norm is None else norm.eps, NORM=norm_kind,
        SILU_MUL=silu_mul, X_TILE=cfg.x_tile and norm is None and not silu_mul,  # a fused input is made as a row
        launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not is_single_split and not fused:
        block_n = 256
        sum_splits_kernel[(m, triton.cdiv(n, block_n))](
            partial, bias_arg, out, n, split_k, partial.stride(0), partial.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_S=triton.next_power_of_2(split_k), BLOCK_N=block_n,
            USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
        )
    return out


_DEFAULT_WORKSPACES: dict[torch.device, SmallMWorkspace] = {}


def _default_workspace(device: torch.device) -> SmallMWorkspace:
    """One module-wide workspace per device for callers without their own (`QuantizedLinear` has its own)."""
    return _DEFAULT_WORKSPACES.setdefault(device, SmallMWorkspace())

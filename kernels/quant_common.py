"""What the quantized GEMM kernels share (`quant_linear`'s large-M GEMMs and `quant_small_m`'s decode GEMV):
argument checks, the SM count, the int8 -> float conversion, and the split-K reduction kernel."""

from __future__ import annotations

import functools
import os

import torch

from tandem.kernels._triton import pdl_prologue, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Below this absolute maximum a row is treated as zero by the quantizers (scale 1e-12 / qmax, codes 0): avoids 0 / 0.
MIN_AMAX = 1e-12


def check_linear_args(op: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None, weight_dtype: torch.dtype, allow_groups: bool) -> int:
    """Validate shapes, dtypes and devices; returns the group size (0: per output channel)."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if qweight.dtype != weight_dtype:
        raise ValueError(f"{op}: qweight must be {weight_dtype}, got {qweight.dtype}")
    if qweight.dim() != 2 or qweight.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: qweight shape {tuple(qweight.shape)} must be [N, K] with K={x.shape[1]} "
                         f"(x's last dimension)")
    num_out, k = qweight.shape
    if scales.dtype != torch.float32:
        raise ValueError(f"{op}: scales must be float32, got {scales.dtype}")
    group_size = 0
    if scales.dim() == 2 and allow_groups and scales.shape[0] == num_out and scales.shape[1] > 0 \
            and k % scales.shape[1] == 0:
        group_size = k // scales.shape[1]
    elif scales.shape != (num_out,):
        expected = f"[{num_out}] or [{num_out}, G] with G dividing K={k}" if allow_groups else f"[{num_out}]"
        raise ValueError(f"{op}: scales shape {tuple(scales.shape)} must be {expected}")
    if bias is not None:
        if bias.shape != (num_out,):
            raise ValueError(f"{op}: bias shape {tuple(bias.shape)} != ({num_out},)")
        if not bias.is_floating_point():
            raise ValueError(f"{op}: bias must be floating point, got {bias.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    return group_size


# int8 -> float32 in registers by integer ops (`int8_to_float32`) instead of the I2F conversion instruction. Hopper
# converts 16 values per clock per SM with I2F (the CUDA guide's throughput table; fp32 FMA: 128): ~4.2 T/s on an
# H200's 132 SMs at 1.98 GHz, below the 4.8 T/s at which HBM delivers int8 weights, so a GEMV that converts every
# weight once can be bound by the conversion rather than the memory. Results are bitwise the same either way.
# The defaults differ by kernel, as measured: the large-M GEMM keeps I2F (offline int8 on an H200, 256 x (1,024, 128):
# 2,576 tok/s with it, 2,295 without); the small-M GEMV at M = 1 converts by integer ops (llama-3.1-8b decode step at
# batch 1 on an H100, two sessions: 4.25 / 4.26 ms against 4.51 / 4.46 with the GEMM; the GEMV with I2F 4.51 / 4.52).
INT8_BITS_ENV = "TANDEM_QUANT_INT8_BITS"  # 1: the integer-op conversion, 0: I2F, in every int8 kernel
INT8_BITS_DEFAULT = False  # the large-M GEMM (`int8_linear._int8_linear_kernel`)
SMALL_M_INT8_BITS_DEFAULT = True  # the small-M GEMV (`quant_small_m._small_m_linear_kernel`)


@functools.lru_cache(maxsize=2)
def int8_bits_default(default: bool = INT8_BITS_DEFAULT) -> bool:
    """Whether an int8 kernel converts by integer ops: $TANDEM_QUANT_INT8_BITS (0 / 1), else the kernel's `default`
    (INT8_BITS_DEFAULT or SMALL_M_INT8_BITS_DEFAULT). Read once (`int8_bits_default.cache_clear()` re-reads)."""
    raw = os.environ.get(INT8_BITS_ENV, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"${INT8_BITS_ENV}={raw!r} must be 0 or 1")
    return raw == "1"


@triton.jit
def int8_to_float32(w):
    """int8 -> float32, exact, with integer ops only. The byte b (as uint8) XOR 0x80 is w + 128 in [0, 255];
    OR-ed under the exponent of 2^23 (0x4B000000) it is the float 2^23 + w + 128, and one subtraction leaves w.
    Both steps are a single XOR with 0x4B000080 and a float add."""
    bits = w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small number exercises the split-K path at tiny shapes
    return torch.cuda.get_device_properties(device).multi_processor_count


def largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


@triton.jit
def sum_splits_kernel(
    partial_ptr, bias_ptr, out_ptr,
    N, num_splits,
    stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # Grid (M, N blocks): sums the K splits in a fixed order, so results do not depend on timing
    # (atomics would), then bias and the cast to the output dtype.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    n_mask = offs_n < N
    partial = tl.load(partial_ptr + offs_s[:, None] * stride_ps + row * stride_pm + offs_n[None, :],
                      mask=(offs_s < num_splits)[:, None] & n_mask[None, :], other=0.0)
    acc = tl.sum(partial, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)

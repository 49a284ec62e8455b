"""FP8 (e4m3) KV cache: the scaling scheme, the quantizer the cache writers share, and their checks.

Scheme: static scales per (layer, kv head). The engine keeps, beside each layer's fp8 K and V pages, a
float32 tensor [2, Hkv] (row 0 the K scales, row 1 the V scales) and passes its rows as `k_scale` and
`v_scale` [Hkv] to `store_kv`, `rope_store_kv`, `paged_decode_attention` and `paged_prefill_attention`.
A value x of kv head h is stored as e4m3(clamp(x / scale[h], -448, 448)) (round to nearest even) and read
back as e4m3 * scale[h].

Why static and per head: a page is written a few tokens at a time by many requests and read by later
steps of all of them, so a scale that moved after a page was written would misread that page; a scale
per page or per token would need its own storage and a read beside every tile. One scale per kv head is
free in the kernels: every attention program works on one kv head, so it folds the K scale into the
softmax scale (q . (k8 * s) = (q . k8) * s) and multiplies the V scale into the output once (sum_n
p_n * v8_n * s = s * sum_n p_n * v8_n); the fp8 tile itself is only converted to q's dtype, which is
exact (every e4m3 value is a bf16, fp16 and fp32 value). It also lets prefill and decode workers agree
on one small tensor per layer: pages move between them as fp8 bytes, so both must use the same scales.

Which scales: 1.0 (vLLM's default for a checkpoint without calibrated k_scale/v_scale) works for
Llama-family models, whose K and V stay well inside e4m3's +-448. e4m3 keeps 3 mantissa bits (a relative
error of at most 2^-4, 6.25%, per element; 2^-5 on average) over its normal range [2^-6, 448]; below
2^-6 (0.0156) values become subnormal and lose relative precision, which is what a calibrated scale
recovers for heads with small values (V often is). A calibration pass (`kv_absmax` over the K/V of some
prompts, the running maximum kept per layer, then `kv_scales_from_absmax`) maps each head's absmax to
448 / headroom (default 2, so a later value twice the calibrated maximum still is not clipped). Scales
must be fixed before the first page is written and stay fixed while any page written with them lives.

The Triton writers quantize with integer bit arithmetic (`fp8_linear._e4m3_bits`), not Triton's
fp32 -> fp8 cast: the interpreter's cast rounds wrongly (-127.89 -> -64), so this is the only way to
check the kernels bit for bit against `quantize_kv` on a CPU; it matches torch's cast on CUDA too. The
readers use Triton's fp8 -> bf16/fp32 conversion (checked exact in the interpreter for all 254 finite
codes; on CUDA it needs sm_89 or newer: Ada, Hopper).
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import tl, triton
from tandem.kernels.fp8_linear import FP8_MAX, _e4m3_bits
from tandem.kernels.quant_common import FP8_DTYPE

FP8_KV_DTYPE = FP8_DTYPE
DEFAULT_HEADROOM = 2.0
_MIN_ABSMAX = 1e-6  # a head whose calibration saw only zeros gets a tiny scale, never 0 (x / 0)


@triton.jit
def quantize_e4m3(x, scale):
    """fp32 x / scale (IEEE division, broadcast), clamped to +-448 -> float8_e4m3fn bit patterns (uint8),
    bit for bit what `quantize_kv` gives."""
    y = tl.math.div_rn(x, scale)
    return _e4m3_bits(tl.minimum(tl.maximum(y, -448.0), 448.0))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] float, scale [Hkv] float32 -> float8_e4m3fn [..., Hkv, D] (x / scale, clamped)."""
    # The clamp matters: torch's cast turns anything past 448 into NaN, not 448.
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] float8_e4m3fn, scale [Hkv] float32 -> float32 [..., Hkv, D]."""
    return x.float() * scale[:, None]


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [N, B, Hkv, D], pages [P] int64 -> [P, B, Hkv, D], a copy; fp8 pages are gathered as bytes, as
    index_select on fp8 tensors is not implemented on every device."""
    if cache.dtype == FP8_KV_DTYPE:
        return cache.view(torch.uint8).index_select(0, pages).view(FP8_KV_DTYPE)
    return cache.index_select(0, pages)


def kv_absmax(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [T, Hkv, D] (one layer's new K/V) -> float32 [2, Hkv], each head's largest |value|.

    For a calibration pass: keep the elementwise maximum over the batches seen, per layer."""
    return torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]).float()


def kv_scales_from_absmax(absmax: torch.Tensor, headroom: float = DEFAULT_HEADROOM) -> torch.Tensor:
    """absmax [2, Hkv] -> scales [2, Hkv] float32 mapping each head's absmax to 448 / headroom."""
    if headroom < 1.0:
        raise ValueError(f"kv_scales_from_absmax: headroom must be >= 1 (values past absmax are clipped "
                         f"otherwise), got {headroom}")
    return absmax.float().clamp_min(_MIN_ABSMAX) * (headroom / FP8_MAX)


def check_kv_cache(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, dtype: torch.dtype | None, dtype_name: str) -> bool:
    """Whether the caches are fp8. An fp8 cache needs k_scale and v_scale [Hkv] float32 on its device; any
    other cache must not be given scales and, when `dtype` is set, must hold `dtype` (that of the tensor
    called `dtype_name`). Raises ValueError naming the argument."""
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if k_cache.dtype != FP8_KV_DTYPE:
        if dtype is not None and k_cache.dtype != dtype:
            raise ValueError(f"{op}: k_cache/v_cache dtype {k_cache.dtype} != {dtype_name} dtype {dtype}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{op}: {name} is only for a {FP8_KV_DTYPE} cache, the cache is {k_cache.dtype}")
        return False
    num_kv_heads = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{op}: a {FP8_KV_DTYPE} cache needs {name} [{num_kv_heads}] float32")
        if s.shape != (num_kv_heads,) or s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(f"{op}: {name} must be float32 [{num_kv_heads}] on {k_cache.device}, got "
                             f"{s.dtype} {tuple(s.shape)} on {s.device}")
    return True

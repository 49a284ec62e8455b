"""Quantized linear layers, one entry point: `QuantWeight` (kind "int8" or "fp8", codes, scales, bias) and the
backend dispatch. The kinds live in their own modules: `tandem.kernels.int8_linear` (weight-only W8A16: the Triton
GEMM, the CPU path over int8 weights in memory, the reference) and `tandem.kernels.fp8_linear` (W8A8 on the fp8
tensor cores, per-token activation scales); decode-sized inputs of both take `tandem.kernels.quant_small_m`'s
weight-only GEMV.

`QuantWeight` bundles (kind, qweight, scales, group_size, bias) and applies itself with one call:

    qw = QuantWeight.quantize(linear.weight, "int8", bias=linear.bias)   # at load
    y = qw.apply(x, backend)                                             # x [..., K] -> [..., N]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.fp8_linear import dequantize_fp8_weight, fp8_linear_torch, fp8_linear_triton, quantize_fp8_weight
from tandem.kernels.int8_linear import (
    dequantize_int8_weight,
    int8_linear_cpu,
    int8_linear_ref,
    int8_linear_triton,
    quantize_int8_weight,
)

QUANT_KINDS = ("int8", "fp8")
BACKENDS = ("torch", "triton", "cpu", "auto")


@dataclass(frozen=True)
class QuantWeight:
    """A quantized linear layer's parameters; `apply(x, backend)` runs it.

    kind "int8": qweight int8 [N, K], scales float32 [N] (group_size None) or [N, K // group_size].
    kind "fp8": qweight float8_e4m3fn [N, K], scales float32 [N] (group_size must be None).
    bias: [N] or None, added in fp32.

    backend: "torch" the references (any device; int8 dequantizes the weight per call), "triton" the
    kernels (CUDA, or TRITON_INTERPRET=1), "cpu" int8 via `int8_linear_cpu` (fp8 has no CPU kernel:
    use "torch"), "auto" = "triton" on CUDA, "cpu" for int8 on the CPU, else "torch". fp8 at small M
    (`use_small_m`) is weight-only on both "triton" and "torch" (`fp8_linear_torch`).
    """

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ValueError(f"QuantWeight: kind {self.kind!r} not one of {QUANT_KINDS}")
        if self.kind == "fp8" and self.group_size is not None:
            raise ValueError("QuantWeight: group_size must be None for kind 'fp8' (per-channel scales only)")
        expected = (self.qweight.shape[0],) if self.group_size is None else \
            (self.qweight.shape[0], self.qweight.shape[1] // self.group_size)
        if tuple(self.scales.shape) != expected:
            raise ValueError(f"QuantWeight: scales shape {tuple(self.scales.shape)} != {expected} "
                             f"for group_size {self.group_size}")

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None,
                 group_size: int | None = None, clip_search: bool = True) -> QuantWeight:
        """Quantize a float weight [N, K] (e.g. `linear.weight`); the bias is kept as given.
        clip_search: see `quantize_int8_weight` (int8 only)."""
        if kind == "int8":
            qweight, scales = quantize_int8_weight(weight, group_size, clip_search)
        elif kind == "fp8":
            if group_size is not None:
                raise ValueError("QuantWeight.quantize: group_size must be None for kind 'fp8'")
            qweight, scales = quantize_fp8_weight(weight)
        else:
            raise ValueError(f"QuantWeight.quantize: kind {kind!r} not one of {QUANT_KINDS}")
        return cls(kind, qweight, scales, group_size, None if bias is None else bias.detach())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these codes stand for."""
        if self.kind == "int8":
            return dequantize_int8_weight(self.qweight, self.scales)
        return dequantize_fp8_weight(self.qweight, self.scales)

    def apply(self, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype."""
        return quant_linear(x, self, backend)


def quant_linear(x: torch.Tensor, weight: QuantWeight, backend: str = "auto") -> torch.Tensor:
    """Dispatch a quantized linear: x [..., K] -> [..., N]; see `QuantWeight` for the backends."""
    if backend not in BACKENDS:
        raise ValueError(f"quant_linear: backend {backend!r} not one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda else ("cpu" if weight.kind == "int8" else "torch")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = linear_function(weight.kind, backend)(x2, weight.qweight, weight.scales, weight.bias)
    return out.reshape(*lead, out.shape[-1])


def linear_function(kind: str, backend: str) -> Callable[..., torch.Tensor]:
    """The function that runs a `kind` linear on `backend` ("torch", "triton" or "cpu"; "auto" resolved by the
    caller): fn(x [M, K], qweight, scales, bias) -> [M, N]. For a caller that picks it once (a model's layer)."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"quant_linear: kind {kind!r} not one of {QUANT_KINDS}")
    if backend not in ("torch", "triton", "cpu"):
        raise ValueError(f"quant_linear: backend {backend!r} not one of ('torch', 'triton', 'cpu')")
    if kind == "int8":
        return {"torch": int8_linear_ref, "triton": int8_linear_triton, "cpu": int8_linear_cpu}[backend]
    if backend == "cpu":
        raise ValueError("quant_linear: no 'cpu' kernel for kind 'fp8'; use backend 'torch'")
    return fp8_linear_torch if backend == "torch" else fp8_linear_triton

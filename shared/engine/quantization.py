"""Weight quantization at load: the four projections of every decoder layer become `QuantizedLinear`s.

`ModelConfig.quantization`:
- "int8": weight-only (W8A16). Symmetric int8 weights with one float32 scale per output channel, absmax / 127;
  the weights stay int8 in memory and every GEMM dequantizes inside the kernel (a quarter of fp32's bytes, half
  of bf16's): the memory-bound decode path.
- "fp8": e4m3 weights with per-output-channel scales (absmax / 448), activations quantized per token on the fly
  (dynamic scales); on Hopper the GEMM runs on the fp8 tensor cores: the compute-bound path.
Embeddings and the output head stay in the model's dtype (the head's error would reach every logit).

Which kernel runs a layer follows the model's `Ops`: with the Triton ops, the Triton kernels
(`int8_linear_triton`, `fp8_linear_triton`: on CUDA, or in Triton's interpreter in the kernel tests). Each picks
by the number of tokens M: up to $TANDEM_QUANT_SMALL_M (by kind: fp8 4, int8 1) the weight-only small-M kernel
(`small_m_linear_triton`, memory-bound decode; fp8 activations are not quantized there), above it the GEMMs
described here. With the torch ops on the CPU, int8 runs `int8_linear_cpu` (`torch._weight_int8pack_mm` over the
int8 weights, bf16 activations) and fp8 the reference `fp8_linear_torch` (by M like the kernels: `fp8_linear_ref`,
which emulates the fp8 arithmetic in fp32, or at small M `fp8_weight_only_ref`), which dequantizes the weight on
every call: it is there to check accuracy on a CPU, not for speed. Elsewhere (CUDA with use_triton=False) the
references run. With the `norm_linear` fusion (`tandem.kernels.ops`), a layer's qkv and gate_up projections of one
token take the RMSNorm before them (and its residual add) into their small-M launch (`add_norm_forward`); with
`silu_linear`, the down projection of one token takes the SwiGLU activation into its launch (`silu_forward`). At the
other end, an fp8 layer's prompt rows (above the small-M limit) may get their input already quantized by its producer:
with `norm_quant` the RMSNorm's kernel quantizes it for qkv and gate_up (`add_norm_quant_forward`), with `silu_quant`
the SwiGLU's for down (`silu_quant_forward`). Triton's int8 GEMM dequantizes the weight once for prompt rows
(`tandem.kernels.int8_linear.int8_dequant_min_m`) and calls cuBLAS.

Scales are plain absmax, not `quantize_int8_weight`'s clip search: that search lowers the weight MSE by ~3%
(its docstring), which is worth little at 8 bits, and costs ~30 s for SmolLM2-135M on a 2-core CPU at every load.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.common.config import ConfigError
from tandem.engine.model import LlamaForCausalLM
from tandem.kernels.fp8_linear import (
    add_rms_norm_quantize_fp8_triton,
    fp8_gemm_triton,
    silu_and_mul_quantize_fp8_triton,
)
from tandem.kernels.quant_linear import QuantWeight, linear_function
from tandem.kernels.quant_small_m import (
    SmallMWorkspace,
    small_m_add_norm_linear_triton,
    small_m_silu_linear_triton,
    use_small_m,
)

# The linears each decoder layer quantizes, by their names under the layer.
QUANTIZED_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class QuantizedLinear(nn.Module):
    """A linear layer over quantized weights: x [T, K] -> [T, N] in x's dtype.

    The codes, scales and bias are buffers (they move with the module and count in its memory); the kernel is
    picked once, at construction, for the module's `backend`.
    """

    def __init__(self, weight: QuantWeight, backend: str) -> None:
        super().__init__()
        self.kind = weight.kind
        self.backend = backend
        self.in_features = weight.qweight.shape[1]
        self.out_features = weight.qweight.shape[0]
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("qweight", weight.qweight)  # [N, K] int8 or float8_e4m3fn
        self.register_buffer("scales", weight.scales)  # [N] float32
        self.register_buffer("bias", weight.bias)  # [N] or None
        self._linear = linear_function(weight.kind, backend)
        # The Triton kernels' small-M path (decode: M <= $TANDEM_QUANT_SMALL_M, 4 for fp8 by default) sums its split-K
        # partials in the same launch with counters of this layer's own (allocated at the first eager call, before
        # any CUDA graph capture); not a buffer: it is no weight, and never saved or counted.
        self._workspace = SmallMWorkspace() if backend == "triton" else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, backend: str) -> QuantizedLinear:
        weight = QuantWeight.quantize(linear.weight.detach(), kind, bias=linear.bias, clip_search=False)
        return cls(weight, backend)

    @property
    def quant_weight(self) -> QuantWeight:
        return QuantWeight(self.kind, self.qweight, self.scales, None, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._workspace is not None:
            return self._linear(x, self.qweight, self.scales, self.bias, workspace=self._workspace)
        return self._linear(x, self.qweight, self.scales, self.bias)

    def _fuses_input(self, x: torch.Tensor) -> bool:
        """Whether this layer's launch can make its own input (a norm, SwiGLU): one token, on the Triton backend,
        where the small-M kernel takes it."""
        return self._workspace is not None and x.shape[0] == 1 and use_small_m(1, kind=self.kind)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RMSNorm of x (+ residual), then this layer, in one launch: (out [1, N], new residual [1, K]) for one token
        on the Triton backend where the small-M kernel takes it (`use_small_m`); None where it cannot (the caller
        runs the norm, then `forward`)."""
        if not self._fuses_input(x):
            return None
        return small_m_add_norm_linear_triton(x, residual, norm_weight, eps, self.qweight, self.scales, self.bias,
                                              workspace=self._workspace)

    def silu_forward(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up, then this layer, in one launch, for one token's gate_up row [1, 2K] on the Triton backend
        where the small-M kernel takes it; None where it cannot (the caller runs `silu_and_mul`, then `forward`)."""
        if not self._fuses_input(gate_up):
            return None
        return small_m_silu_linear_triton(gate_up, self.qweight, self.scales, self.bias, workspace=self._workspace)

    def _takes_w8a8_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows run this fp8 layer's W8A8 GEMM on the Triton backend (above the small-M limit: a prompt
        step), so that a producer may hand it quantized rows."""
        return (self.kind == "fp8" and self._workspace is not None and x.dim() == 2
                and not use_small_m(x.shape[0], kind="fp8"))

    def add_norm_quant_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RMSNorm of x (+ residual) quantized per token in one kernel, then this fp8 layer's W8A8 GEMM: (out [M, N],
        new residual [M, K]) for a prompt step's rows (`_takes_w8a8_rows`); None where that path does not run (the
        caller runs the norm, then `forward`). The same result as theirs, bit for bit."""
        if not self._takes_w8a8_rows(x):
            return None
        qx, x_scales, new_residual = add_rms_norm_quantize_fp8_triton(x, residual, norm_weight, eps)
        return fp8_gemm_triton(qx, x_scales, self.qweight, self.scales, self.bias, x.dtype), new_residual

    def silu_quant_forward(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up quantized per token in one kernel, then this fp8 layer's W8A8 GEMM, for gate_up rows
        [M, 2K] on the Triton backend above the small-M limit (a prompt step); None where that path does not run
        (the caller runs `silu_and_mul`, then `forward`). The same result as theirs, bit for bit."""
        if not self._takes_w8a8_rows(gate_up):
            return None
        qx, x_scales = silu_and_mul_quantize_fp8_triton(gate_up)
        return fp8_gemm_triton(qx, x_scales, self.qweight, self.scales, self.bias, gate_up.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"backend={self.backend}, bias={self.bias is not None}")


def linear_backend(kind: str, ops_name: str, device: torch.device) -> str:
    """The `quant_linear` backend of a layer: Triton with the Triton ops, the int8 CPU kernel on the CPU, else the
    references (see the module docstring)."""
    if ops_name == "triton":
        return "triton"
    if device.type == "cpu" and kind == "int8":
        return "cpu"
    return "torch"


@torch.no_grad()
def quantize_linears(model: LlamaForCausalLM, method: str, device: torch.device | None = None) -> int:
    """Replace the projections of every decoder layer of `model` (weights loaded) by `QuantizedLinear`s of
    `method` ("int8" | "fp8"), on the weights' device; returns how many were replaced. The full-precision weights
    are released as each layer is done. `device`: the device the layers' kernels are picked for, when it is not the
    weights' (a structure built on the meta device for weights mapped later)."""
    device = device or model.lm_head.weight.device
    if method == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"quantization: fp8 needs fp8 tensor cores (compute capability >= 8.9), {device} has "
                          f"{torch.cuda.get_device_capability(device)}")
    backend = linear_backend(method, model.ops.name, device)
    count = 0
    for layer in model.model.layers:
        for name in QUANTIZED_PROJECTIONS:
            parent_name, attr = name.split(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}, not nn.Linear"
            setattr(parent, attr, QuantizedLinear.from_linear(linear, method, backend))
            count += 1
    if model.lm_head.weight.is_cuda:
        # The bf16 weights' memory goes back to the device: the KV pool is sized from what this process holds.
        torch.cuda.empty_cache()
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held in memory: parameters and buffers (quantized codes, scales), shared
    tensors once, plus the oneDNN-packed copies `pack_linears` keeps beside the CPU's fp32 linears (opaque tensors:
    counted by their logical size)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    packed: list[torch.Tensor] = [w for w in (getattr(m, "packed_weight", None) for m in model.modules())
                                  if isinstance(w, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*tensors.values(), *packed])

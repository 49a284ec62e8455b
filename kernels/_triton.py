"""Triton, guarded: the kernel modules import (and their torch references run) where triton is missing.

Every kernel module takes `triton` and `tl` from here. Without triton, `triton.jit` returns a stub
whose launch raises, so `import tandem.kernels` and the `torch` backend still work on CPU-only
installs; the wrappers call `check_launchable` first to fail with a clear message instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: only the references are usable.
    HAS_TRITON = False

    class _KernelStub:
        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            raise RuntimeError(f"{self.fn.__name__}: triton is not installed; use the 'torch' backend")

    class _TritonStub:
        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
            return _KernelStub(fn) if fn is not None else _KernelStub

    triton = _TritonStub()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]  # only named in string annotations, never evaluated

# Programmatic dependent launch (Hopper and later): Triton's grid-dependency-control ops, where this Triton has them.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:
    HAS_GDC = False

# Triton decides at decoration time (our import) whether kernels run in its interpreter; read the
# same switch once here so the wrappers agree with it.
IS_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(op: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error when the Triton kernel of `op` cannot run on these tensors."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: triton is not installed; use the 'torch' backend")
    for t in tensors:
        if not t.is_cuda and not IS_INTERPRETING:
            raise ValueError(f"{op}: triton kernels need CUDA tensors (or TRITON_INTERPRET=1), "
                             f"got {t.device}")


def check_last_dim_contiguous(op: str, **tensors: torch.Tensor) -> None:
    """The kernels address rows by stride but assume unit stride along the last dimension."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dimension, strides {t.stride()}")


def check_out(op: str, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """An attention op's caller-given output: q's shape and dtype and device, unit last stride (any row strides)."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"{op}: out must be {tuple(q.shape)} {q.dtype} on {q.device} with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs to tl.dot default to TF32 on GPU; ask for full precision so fp32 matches the ref."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- programmatic dependent launch ----------------------------------------------------------------------------
# A decode step is a chain of small dependent kernels (~10 per layer at batch 1); between two of them the GPU drains
# one grid, then launches and ramps up the next. With PDL (sm_90+) a kernel launched with `launch_pdl=True` may start
# while its predecessor finishes: each program first waits for the whole previous grid (`gdc_wait`: its writes
# visible), then lets the next kernel launch (`gdc_launch_dependents`), so what overlaps is the launch and the tail,
# never a read of unfinished data or a write over data still being read. Every kernel on the decode path takes
# `USE_PDL` and calls `pdl_prologue(USE_PDL)` before touching global memory; a kernel launched with PDL that skipped
# the wait would race. Off unless $TANDEM_PDL=1: on an H100 it saved 4.5-4.7% of a quantized 8B batch-1 step, but fp8's
# logprobs then differed inside CUDA graphs for a 4-token prompt (docs/architecture.md, "Kernels and the GPU path").
PDL_ENV = "TANDEM_PDL"


@functools.lru_cache(maxsize=1)
def pdl_requested() -> bool:
    """$TANDEM_PDL: "1" turns programmatic dependent launch on where the device has it, "0" or unset leaves it off
    (read once; `pdl_requested.cache_clear()` re-reads)."""
    raw = os.environ.get(PDL_ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"${PDL_ENV}={raw!r} must be 0 or 1")
    return raw == "1"


@functools.lru_cache(maxsize=8)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: requested, a CUDA device of compute capability 9.0 or more, and a
    Triton with the grid-dependency ops (never in the interpreter). The kernel's `USE_PDL` and its launch's
    `launch_pdl` take this same value."""
    if not (pdl_requested() and HAS_TRITON and HAS_GDC and not IS_INTERPRETING and device.type == "cuda"):
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


if HAS_TRITON:
    @triton.jit
    def pdl_prologue(USE_PDL: tl.constexpr):
        """First thing in a kernel launched with PDL: wait for the previous grid, then let the next one launch."""
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    def pdl_prologue(USE_PDL: Any) -> None:  # noqa: N803 - the kernels' constexpr name
        raise RuntimeError("triton is not installed")

"""Triton, guarded: the kernel modules import (and their torch references run) where triton is missing.

Every kernel module takes `triton` and `tl` from here. Without triton, `triton.jit` returns a stub
whose launch raises, so `import tandem.kernels` and the `torch` backend still work on CPU-only
installs; the wrappers call `check_launchable` first to fail with a clear message instead.
"""

from __future__ import annotations

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

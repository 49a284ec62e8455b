"""The backend bundle: selection, and that the torch backend needs no triton at all."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from tandem.kernels import Ops, get_ops, triton_available
from tandem.kernels import _triton as guarded_triton

OP_NAMES = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv",
            "prefill_attention", "paged_decode_attention", "paged_prefill_attention"]


def test_backends_expose_every_op() -> None:
    fields = [f.name for f in dataclasses.fields(Ops)]
    assert fields == ["name", *OP_NAMES]
    torch_ops = get_ops("torch")
    assert torch_ops.name == "torch"
    assert all(getattr(torch_ops, op).__name__ == f"{op}_ref" for op in OP_NAMES)
    if guarded_triton.HAS_TRITON:
        triton_ops = get_ops("triton")
        assert triton_ops.name == "triton"
        assert all(getattr(triton_ops, op).__name__ == f"{op}_triton" for op in OP_NAMES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        torch_ops.name = "other"  # type: ignore[misc]


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cuda")


def test_triton_available() -> None:
    expected_on_cpu = guarded_triton.HAS_TRITON and guarded_triton.IS_INTERPRETING
    assert triton_available(torch.device("cpu")) == expected_on_cpu
    assert triton_available(torch.device("cuda")) == guarded_triton.HAS_TRITON


def test_torch_backend_works_without_triton() -> None:
    # A fresh interpreter where `import triton` fails, as on a CPU-only install without the extra.
    script = """
import sys
sys.modules["triton"] = None
import torch
from tandem.kernels import get_ops, triton_available
ops = get_ops("torch")
out = ops.silu_and_mul(torch.randn(2, 8))
assert out.shape == (2, 4)
assert not triton_available(torch.device("cpu"))
try:
    get_ops("triton")
except RuntimeError as e:
    assert "not installed" in str(e)
else:
    raise AssertionError("get_ops('triton') should fail without triton")
from tandem.kernels.rms_norm import rms_norm_triton
try:
    rms_norm_triton(torch.randn(2, 8), torch.ones(8), 1e-5)
except RuntimeError as e:
    assert "not installed" in str(e)
else:
    raise AssertionError("a triton wrapper should fail without triton")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")

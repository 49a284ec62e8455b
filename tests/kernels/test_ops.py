"""The backend bundle: selection, and that the torch backend needs no triton at all."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from tandem.kernels import Ops, get_ops, triton_available
from tandem.kernels import _triton as guarded_triton
from tandem.kernels.ops import FUSIONS, FUSIONS_ENV, OPT_IN_FUSIONS, fusions_label, parse_fusions

OP_NAMES = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv", "rope_store_kv",
            "prefill_attention", "paged_decode_attention", "paged_prefill_attention"]
FUSED_OPS = {"rope_store": "rope_store_kv", "add_norm": "fused_add_rms_norm"}  # fusion -> the op it implements
# Opt-in fusion -> (its op, the op's function name with the fusion on).
OPT_IN_OPS = {"attn_combine": ("paged_decode_attention", "paged_decode_attention_one_launch")}


def test_backends_expose_every_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FUSIONS_ENV, raising=False)
    fields = [f.name for f in dataclasses.fields(Ops)]
    assert fields == ["name", *OP_NAMES, "fusions"]
    torch_ops = get_ops("torch")
    assert torch_ops.name == "torch" and torch_ops.fusions == frozenset()
    assert all(getattr(torch_ops, op).__name__ == f"{op}_ref" for op in OP_NAMES)
    assert get_ops("torch", "none") is torch_ops  # the references are the same arithmetic either way
    if guarded_triton.HAS_TRITON:
        triton_ops = get_ops("triton")
        assert triton_ops.name == "triton" and triton_ops.fusions == set(FUSIONS) == set(FUSED_OPS)
        assert all(getattr(triton_ops, op).__name__ == f"{op}_triton" for op in OP_NAMES)
        assert get_ops("triton", "all") is triton_ops
    with pytest.raises(dataclasses.FrozenInstanceError):
        torch_ops.name = "other"  # type: ignore[misc]


@pytest.mark.skipif(not guarded_triton.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("spec", ["none", "rope_store", "add_norm", "all", "rope_store+add_norm", "attn_combine",
                                  "all+attn_combine"])
def test_each_fusion_switches_one_op(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fusion off: its op is the unfused kernels one after the other (for an opt-in one: the plain kernel); every
    other op is the same."""
    chosen = parse_fusions(spec)
    monkeypatch.setenv(FUSIONS_ENV, spec)
    ops = get_ops("triton")
    assert ops.fusions == chosen and ops is get_ops("triton", chosen)
    assert parse_fusions(fusions_label(chosen)) == chosen
    for op in OP_NAMES:
        fused_by = [fusion for fusion, fused_op in FUSED_OPS.items() if fused_op == op]
        expected = f"{op}_unfused" if fused_by and fused_by[0] not in chosen else f"{op}_triton"
        for fusion, (opt_in_op, name) in OPT_IN_OPS.items():
            if op == opt_in_op and fusion in chosen:
                expected = name
        assert getattr(ops, op).__name__ == expected, op


def test_fusion_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_fusions("all") == parse_fusions(" rope_store , add_norm ") == frozenset(FUSIONS)
    assert parse_fusions("none") == parse_fusions("") == parse_fusions([]) == frozenset()
    assert fusions_label(frozenset()) == "none" and fusions_label(frozenset(FUSIONS)) == "all"
    # norm_linear, silu_linear, silu_quant and norm_quant are no ops of the bundle: the model's layers apply them
    # (tests/kernels/test_norm_linear_model.py).
    assert set(OPT_IN_OPS) | {"norm_linear", "silu_linear", "silu_quant", "norm_quant"} == set(OPT_IN_FUSIONS)
    assert not set(OPT_IN_FUSIONS) & parse_fusions("all")
    assert fusions_label(parse_fusions("attn_combine,rope_store,add_norm")) == "all+attn_combine"
    assert fusions_label(parse_fusions("attn_combine+add_norm")) == "add_norm+attn_combine"
    with pytest.raises(ValueError, match="unknown fusion 'rope'"):
        parse_fusions("rope,add_norm")
    monkeypatch.setenv(FUSIONS_ENV, "add-norm")
    with pytest.raises(ValueError, match="unknown fusion 'add-norm'"):
        get_ops("torch")


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

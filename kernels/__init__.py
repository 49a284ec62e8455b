"""Fused Triton kernels, each with a pure-torch reference beside it; `get_ops` picks a backend. Imports nothing
of tandem outside this package."""

from tandem.kernels.ops import Ops, get_ops, triton_available

__all__ = ["Ops", "get_ops", "triton_available"]

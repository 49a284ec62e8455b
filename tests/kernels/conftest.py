"""Kernel tests: Triton kernels against their torch references; on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is decorated (when tandem.kernels is first imported),
# so on a CPU the Triton tests need TRITON_INTERPRET=1 in the environment from the start: `.ci/test` runs
# this folder in its own pytest process with it. Setting it here instead would leak into every other test
# of the session and into the services they start, which would then run SmolLM2 through the interpreter.
from tandem.kernels import triton_available  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# bf16 only on GPU: the interpreter runs bf16 through numpy emulation, slowly and not like hardware.
DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32]
TOLERANCES = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests taking `dtype` run per DTYPES, unless they parametrize it themselves."""
    markers = metafunc.definition.iter_markers("parametrize")
    is_explicit = any("dtype" in str(marker.args[0]) for marker in markers)
    if "dtype" in metafunc.fixturenames and not is_explicit:
        metafunc.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def tol(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES[dtype]


@pytest.fixture
def needs_triton(device: torch.device) -> None:
    """Skip (with the reason) where the Triton kernels cannot run on this device."""
    if not triton_available(device):
        pytest.skip("triton kernels unavailable: no CUDA, and not run under TRITON_INTERPRET=1 "
                    "(`TRITON_INTERPRET=1 pytest tests/kernels`, as .ci/test does), or triton is missing")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

"""Where programmatic dependent launch may let a kernel read data too early (Hopper, $TANDEM_PDL's machinery): a slow
eager kernel writes a buffer, then a kernel launched with PDL copies it: eagerly, as the first node of a replayed CUDA
graph (how the piecewise graphs start: after an eager attention kernel or another graph), and as a graph's second
node after a plain kernel. Each copy must see the finished buffer. (A diagnostic for the fp8 logprob difference with
PDL on in the piecewise graphs, docs/architecture.md.)"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels._triton import HAS_GDC, pdl_prologue, tl, triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK = 1024
SPIN = 400_000  # dependent adds: ~1 ms, far longer than a launch


@triton.jit
def _slow_write(out_ptr, n_iter, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(n_iter):
        acc += 1.0
    tl.store(out_ptr + offs, acc)


@triton.jit
def _copy(src_ptr, dst_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def _copy_pdl(src: torch.Tensor, dst: torch.Tensor) -> None:
    _copy[(1,)](src, dst, BLOCK=BLOCK, USE_PDL=True, launch_pdl=True)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs compute capability 9.0 (Hopper) or later")
@pytest.mark.parametrize("where", ["eager", "graph root", "graph after a plain kernel"])
def test_a_pdl_kernel_sees_the_previous_kernels_writes(where: str) -> None:
    assert HAS_GDC
    src = torch.zeros(BLOCK, device="cuda")
    dst = torch.zeros(BLOCK, device="cuda")
    graph = None
    if where != "eager":
        _copy_pdl(src, dst)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            if where == "graph after a plain kernel":
                src.add_(0.0)  # a plain (non-PDL) kernel as the graph's root
            _copy_pdl(src, dst)
    _slow_write[(1,)](src, 10, BLOCK=BLOCK)  # compile
    results = []
    for _ in range(5):
        src.zero_()
        dst.fill_(-1.0)
        torch.cuda.synchronize()
        _slow_write[(1,)](src, SPIN, BLOCK=BLOCK)
        if graph is None:
            _copy_pdl(src, dst)
        else:
            graph.replay()
        torch.cuda.synchronize()
        results.append(float(dst.min()))
    assert results == [float(SPIN)] * 5, f"{where}: the copy saw {results}"

"""The compile watch counts Triton compiles by phase and names the kernels a request waited for.

Triton compiles nothing on the CPU (the interpreter runs kernels as Python), so these tests drive the process-wide
hook the way Triton's JIT calls it after a compile (the keyword arguments of `JITFunction._call_hook`)."""

from __future__ import annotations

import logging

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.runtime.jit import JitFunctionInfo  # noqa: E402

from tandem.engine.compile_watch import CompileWatch  # noqa: E402


def _compiled(name: str) -> None:
    """What Triton does after compiling a kernel called `name`."""
    hook = knobs.runtime.jit_post_compile_hook
    assert hook is not None
    hook(key=(name,), repr=f"{name}[num_warps=4](x: *bf16, n: i32)", fn=JitFunctionInfo(__name__, name, None),
         compile={}, is_manual_warmup=False, already_compiled=False)


@pytest.fixture
def no_hook():
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = None
    yield
    knobs.runtime.jit_post_compile_hook = previous


def test_compiles_after_start_up_are_counted_named_and_logged(no_hook, caplog):
    seen: list[str] = []
    watch = CompileWatch(seen.append)
    _compiled("_store_kv_kernel")
    _compiled("_paged_decode_kernel")
    assert (watch.num_startup, watch.num_serving, seen) == (2, 0, [])
    watch.serving()
    with caplog.at_level(logging.WARNING, logger="tandem.engine.compile_watch"):
        _compiled("_store_kv_kernel")
    assert (watch.num_startup, watch.num_serving, seen) == (2, 1, ["_store_kv_kernel"])
    assert "_store_kv_kernel while serving" in caplog.text and "x: *bf16, n: i32" in caplog.text
    assert watch.take() == ["_store_kv_kernel"] and watch.take() == []
    watch.close()
    assert knobs.runtime.jit_post_compile_hook is None


def test_an_earlier_hook_still_runs(no_hook):
    earlier: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kwargs: earlier.append(kwargs["fn"].name)
    watch = CompileWatch()
    _compiled("_rms_norm_kernel")
    assert earlier == ["_rms_norm_kernel"] and watch.num_startup == 1
    watch.close()
    _compiled("_silu_kernel")
    assert earlier == ["_rms_norm_kernel", "_silu_kernel"] and watch.num_startup == 1

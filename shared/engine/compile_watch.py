"""Triton compiles, counted by phase: a worker compiles its kernels while it starts (CUDA graph capture and
`Engine.warm_up`); a compile after that means a request waited for it (0.5-3 s on an H200 with a cold cache, a few
ms to load from Triton's disk cache). Each such compile is logged with the kernel and its specialisation (which
argument's alignment, divisibility or dtype warm-up did not reach), so a slow first request can be traced to it.

Triton has one process-wide post-compile hook; the watch chains to a hook installed before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class CompileWatch:
    """Counts Triton compiles while starting and while serving; `on_serving_compile(kernel)` is called for each
    of the latter (a metric, for instance). A no-op where Triton does not compile (the CPU, the references)."""

    def __init__(self, on_serving_compile: Callable[[str], None] | None = None) -> None:
        self.num_startup = 0
        self.num_serving = 0
        self.serving_kernels: list[str] = []  # by name, in order (until taken)
        self._serving = False
        self._on_serving_compile = on_serving_compile
        self._previous: Callable[..., Any] | None = None
        self.installed = False
        try:
            from triton import knobs
        except ImportError:
            return
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        self.installed = True

    def serving(self) -> None:
        """Start-up is over: from now on every compile is one a request waited for."""
        self._serving = True
        log.info("Triton compiled %d kernel variants while starting", self.num_startup)

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")  # Triton's JitFunctionInfo(module, name, jit_function)
        name = str(getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn)))
        if self._serving:
            self.num_serving += 1
            self.serving_kernels.append(name)
            log.warning("Triton compiled %s while serving (warm-up did not reach this variant): %s", name,
                        kwargs.get("repr", ""))
            if self._on_serving_compile is not None:
                self._on_serving_compile(name)
        else:
            self.num_startup += 1
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return False

    def take(self) -> list[str]:
        """The kernels compiled while serving since the last `take`."""
        names, self.serving_kernels = self.serving_kernels, []
        return names

    def close(self) -> None:
        """Put back the hook that was there before."""
        if not self.installed:
            return
        from triton import knobs
        if knobs.runtime.jit_post_compile_hook == self._hook:
            knobs.runtime.jit_post_compile_hook = self._previous
        self.installed = False

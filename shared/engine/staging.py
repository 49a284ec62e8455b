"""Pinned host memory for a step's inputs, allocated once and reused.

A step's inputs (token ids, positions, slots, block tables, ...) go to the GPU by asynchronous copies, which need
pinned host memory. `Tensor.pin_memory()` per input per step took ~10% of a decode worker's engine thread on an
H200 (llama-3.2-1b, 256 streams, py-spy: `benchmarks/results/h200-2026-12-04/2-burst/`): each call goes through
torch's caching host allocator, which queries the CUDA events of every block it has handed out. Here a step writes
its inputs into one of a few fixed arenas instead, and an arena is written again only after the copies that read it
have finished (a CUDA event recorded when the step's copies were queued, a few steps ago: in practice a no-op wait).
"""

from __future__ import annotations

import array
import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# "0": every input pinned on its own (`Tensor.pin_memory()`), as before (the A/B switch of the benchmarks).
STAGING_ENV = "TANDEM_HOST_STAGING"
# Per arena: a decode step at a batch of 256 with 8,192-token contexts needs ~0.5 MiB (its block table), a
# 16,384-token prefill step ~0.4 MiB; a step that needs more pins its inputs one by one.
ARENA_BYTES = 4 << 20
# Arenas in the ring: a step launched ahead of the host (async scheduling) and the one being read may both be in
# flight while a third is written.
NUM_ARENAS = 3
_ALIGN = 64


class HostStaging:
    """A ring of pinned arenas. Inside `step()`, `tensor(values, dtype)` returns the values in pinned memory of the
    current arena; outside a step (or past the arena's end) it pins a fresh tensor."""

    def __init__(self, arena_bytes: int = ARENA_BYTES, num_arenas: int = NUM_ARENAS) -> None:
        self.arenas = [torch.empty(arena_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_arenas)]
        # Each arena's bytes as a memoryview: its slice assignment copies without leaving the GIL (ctypes.memmove,
        # a foreign call, drops it and takes it back) and costs half as much (1.6 against 3.2 µs for 2 KiB beside a
        # busy thread on the 2-core CPU VM).
        self._views = [memoryview((ctypes.c_char * arena_bytes).from_address(a.data_ptr())).cast("B")
                       for a in self.arenas]
        self._events: list[torch.cuda.Event | None] = [None] * num_arenas
        self._index = -1
        self._offset: int | None = None  # None: not in a step
        self.num_fallbacks = 0  # inputs pinned on their own inside a step (the arena was full)

    @contextmanager
    def step(self) -> Iterator[None]:
        """The inputs of one step: they are copied to the device (queued on the current stream) before it ends."""
        if self._offset is not None:  # nested: part of the step already open
            yield
            return
        self._index = (self._index + 1) % len(self.arenas)
        event = self._events[self._index]
        if event is not None:
            event.synchronize()  # the copies of the step that last wrote this arena
        self._offset = 0
        try:
            yield
        finally:
            self._offset = None
            done = torch.cuda.Event()
            done.record()
            self._events[self._index] = done

    def tensor(self, values: array.array, dtype: torch.dtype) -> torch.Tensor:
        """`values` (an array of `dtype`'s item size) as a pinned 1-D tensor of `dtype`."""
        nbytes = len(values) * values.itemsize
        offset = self._offset
        if offset is None or offset + nbytes > self.arenas[self._index].numel():
            if offset is not None:
                self.num_fallbacks += 1
            return torch.frombuffer(values, dtype=dtype).pin_memory() if nbytes else torch.empty(0, dtype=dtype)
        if nbytes:
            self._views[self._index][offset:offset + nbytes] = memoryview(values).cast("B")
        self._offset = offset + -(-nbytes // _ALIGN) * _ALIGN
        return self.arenas[self._index][offset:offset + nbytes].view(dtype)


def staging_enabled() -> bool:
    return os.environ.get(STAGING_ENV, "1") != "0"

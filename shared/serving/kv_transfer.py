"""KV pages over gRPC: the layout check, tensors ↔ `KVPages` messages (raw bytes + CRC32).

Pages travel as raw little-endian tensor bytes (no per-element protobuf encoding), chunked by blocks
so that each message stays well under the channel's message-size limit.
"""

from __future__ import annotations

import logging
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tandem.common.config import KVLayout
from tandem.common.errors import LayoutMismatchError
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

# Each KVPages message carries at most this many bytes of K plus V.
MAX_CHUNK_BYTES = 4 * 1024 * 1024


def check_layout(mine: KVLayout, theirs: KVLayout) -> None:
    """Refuse to exchange pages between different layouts, naming every field that differs."""
    if mine == theirs:
        return
    diffs = [f"{name}: ours {getattr(mine, name)!r}, theirs {getattr(theirs, name)!r}"
             for name in mine.__dataclass_fields__ if getattr(mine, name) != getattr(theirs, name)]
    raise LayoutMismatchError("KV layout mismatch (" + "; ".join(diffs) + ")")


def _raw_bytes(t: torch.Tensor) -> bytes:
    # Viewed as bytes first: numpy has no bfloat16, and this keeps the copy a plain memcpy.
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def pages_to_messages(layer: int, k: torch.Tensor, v: torch.Tensor,
                      max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[worker_pb2.KVPages]:
    """One layer's pages ([num_blocks, block_size, Hkv, D] each, on the CPU) as chunked messages."""
    num_blocks = k.shape[0]
    block_bytes = 2 * k[0].numel() * k.element_size()
    per_chunk = max(1, max_chunk_bytes // block_bytes)
    for start in range(0, num_blocks, per_chunk):
        k_bytes = _raw_bytes(k[start:start + per_chunk])
        v_bytes = _raw_bytes(v[start:start + per_chunk])
        yield worker_pb2.KVPages(layer=layer, block_start=start, num_blocks=min(per_chunk, num_blocks - start),
                                 k=k_bytes, v=v_bytes, crc32=zlib.crc32(v_bytes, zlib.crc32(k_bytes)))


def page_bytes(message: worker_pb2.KVPages, layout: KVLayout) -> int:
    """K plus V bytes a pages message carries (without reading its bytes fields: each read may copy them)."""
    return 2 * message.num_blocks * layout.block_bytes_per_layer


def messages_to_pages(message: worker_pb2.KVPages, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the checksum and the size, and view the bytes as K and V tensors on the CPU (read-only views
    of the message's bytes: copy before writing into them)."""
    k_bytes, v_bytes = message.k, message.v  # each read of a bytes field may copy it: read once
    if zlib.crc32(v_bytes, zlib.crc32(k_bytes)) != message.crc32:
        raise ValueError(f"KV pages of layer {message.layer} failed their CRC32 check")
    dtype = getattr(torch, layout.dtype)
    shape = (message.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    expected = message.num_blocks * layout.block_bytes_per_layer
    if len(k_bytes) != expected or len(v_bytes) != expected:
        raise ValueError(f"KV pages of layer {message.layer}: {len(k_bytes)} bytes, expected {expected}")
    # Views of the bytes, not copies: they are only read (written into the pool), and live as long as the
    # tensors do. torch warns that the buffer is read-only; that is the point here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        k = torch.frombuffer(k_bytes, dtype=torch.uint8).view(dtype).view(shape)
        v = torch.frombuffer(v_bytes, dtype=torch.uint8).view(dtype).view(shape)
    return k, v


class PageExporter:
    """One layer's pages of a request → `KVPages` messages, without holding up the engine thread.

    On a GPU the gather and the device→host copy (into pinned memory) are queued on a side stream behind
    an event of the compute stream, so the engine goes on launching the next layer while this one's pages
    come down; bytes and CRC32s are then made on one worker thread, in submission order, once the copy
    has landed. On a CPU the pages are gathered at once and the rest is done on the worker thread.
    `cache` is the pool, [layers, 2, blocks, block_size, kv_heads, head_dim].
    """

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-export")

    def submit(self, layer: int, block_ids: list[int],
               deliver: Callable[[list[worker_pb2.KVPages]], None]) -> None:
        """Engine thread, once `layer` has stored its K/V (queued on the current stream): `deliver(messages)`
        runs on the worker thread when they are ready."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        done: torch.cuda.Event | None = None
        if self.stream is None:
            k, v = self.cache[layer, 0, index], self.cache[layer, 1, index]
        else:
            computed = torch.cuda.Event()
            computed.record()
            shape = (len(block_ids), *self.cache.shape[3:])
            k = torch.empty(shape, dtype=self.cache.dtype, pin_memory=True)
            v = torch.empty(shape, dtype=self.cache.dtype, pin_memory=True)
            index = index.pin_memory()
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(computed)
                on_device = index.to(self.cache.device, non_blocking=True)
                k.copy_(self.cache[layer, 0].index_select(0, on_device), non_blocking=True)
                v.copy_(self.cache[layer, 1].index_select(0, on_device), non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
        self._worker.submit(self._deliver, layer, k, v, done, deliver)

    def flush(self) -> Future[None]:
        """Done once everything submitted before has been delivered."""
        return self._worker.submit(lambda: None)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _deliver(layer: int, k: torch.Tensor, v: torch.Tensor, done: torch.cuda.Event | None,
                 deliver: Callable[[list[worker_pb2.KVPages]], None]) -> None:
        try:
            if done is not None:
                done.synchronize()
            deliver(list(pages_to_messages(layer, k, v)))
        except Exception:  # the request's stream then ends without these pages: the receiver sees a short transfer
            log.exception("exporting KV pages of layer %d failed", layer)

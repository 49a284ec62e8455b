"""KV pages over gRPC: the layout check, tensors ↔ `KVPages` messages (raw bytes + CRC32).

Pages travel as raw little-endian tensor bytes (no per-element protobuf encoding), chunked by blocks
so that each message stays well under the channel's message-size limit.
"""

from __future__ import annotations

import logging
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tandem.common.config import KVLayout
from tandem.common.errors import LayoutMismatchError
from tandem.engine.kv_cache import as_bytes
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

# Each KVPages message carries at most this many bytes of K plus V. Kept small so that the exporter thread holds
# the GIL only briefly per copy (making bytes and messages does not release it).
MAX_CHUNK_BYTES = 1024 * 1024
# The GIL switch interval (s) of a process that exports pages: the exporter thread's copies would otherwise keep
# the engine thread from launching the next layer's kernels for up to Python's default 5 ms at a time.
EXPORT_SWITCH_INTERVAL_S = 0.0005


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


def pages_to_messages(layer: int, k: torch.Tensor, v: torch.Tensor, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                      first_block: int = 0) -> Iterator[worker_pb2.KVPages]:
    """One layer's pages ([num_blocks, block_size, Hkv, D] each, on the CPU) as chunked messages; the first of
    them is the request's block number `first_block` (a prompt computed in chunks ships its blocks as they fill)."""
    num_blocks = k.shape[0]
    block_bytes = 2 * k[0].numel() * k.element_size()
    per_chunk = max(1, max_chunk_bytes // block_bytes)
    for start in range(0, num_blocks, per_chunk):
        k_bytes = _raw_bytes(k[start:start + per_chunk])
        v_bytes = _raw_bytes(v[start:start + per_chunk])
        yield worker_pb2.KVPages(layer=layer, block_start=first_block + start,
                                 num_blocks=min(per_chunk, num_blocks - start),
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
    """The pages of a prefill step's requests → `KVPages` messages, layer by layer, without holding up the
    engine thread: one hand-off per layer per step, whatever the number of requests.

    `begin_step` (once per step) puts the step's block ids on the device in one copy; then, per layer, the
    gather of every request's K and V pages and one device→host copy into a reusable pinned buffer are queued on
    a side stream behind an event of the compute stream, so the engine goes on launching the next layer while
    this one's pages come down. Bytes, CRC32s and messages are made on one worker thread, in submission order,
    once the copy has landed. On a CPU the gather happens at once and the rest on the worker thread.
    `cache` is the pool, [layers, 2, blocks, block_size, kv_heads, head_dim].
    """

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-export")
        # Pinned staging buffers by capacity in blocks (a power of two), handed back by the worker thread.
        self._staging: dict[int, list[torch.Tensor]] = {}
        self._staging_lock = threading.Lock()

    def begin_step(self, requests: list[tuple[str, int, list[int]]],
                   deliver: Callable[[str, list[worker_pb2.KVPages]], None]) -> Callable[[int], None]:
        """Engine thread, before the step's forward: `requests` are (request id, index of the first block this step
        writes in the request's own block list, those blocks' ids). Returns what to call with each layer's index
        once it has stored its K/V (queued on the current stream); `deliver(req_id, messages)` then runs on the
        worker thread with that request's messages of that layer."""
        block_ids = [b for _, _, blocks in requests for b in blocks]
        spans, start = [], 0
        for req_id, first_block, blocks in requests:
            spans.append((req_id, first_block, start, len(blocks)))
            start += len(blocks)
        index = torch.tensor(block_ids, dtype=torch.int64)
        if self.stream is not None:
            index = index.pin_memory().to(self.cache.device, non_blocking=True)
            index.record_stream(self.stream)  # read on the side stream after this step's tensors are released

        def layer_done(layer: int) -> None:
            done: torch.cuda.Event | None = None
            if self.stream is None:
                pages = as_bytes(self.cache[layer]).index_select(1, index).view(self.cache.dtype)  # [2, n, bs, Hkv, D]
            else:
                computed = torch.cuda.Event()
                computed.record()
                pages = self._take_staging(len(block_ids))
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(computed)
                    as_bytes(pages).copy_(as_bytes(self.cache[layer]).index_select(1, index), non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.stream)
            self._worker.submit(self._deliver, layer, pages, done, spans, deliver)

        return layer_done

    def flush(self) -> Future[None]:
        """Done once everything submitted before has been delivered."""
        return self._worker.submit(lambda: None)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _take_staging(self, num_blocks: int) -> torch.Tensor:
        capacity = 1 << max(0, num_blocks - 1).bit_length()
        with self._staging_lock:
            free = self._staging.get(capacity)
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = torch.empty((2, capacity, *self.cache.shape[3:]), dtype=self.cache.dtype, pin_memory=True)
        return buffer[:, :num_blocks]

    def _give_back(self, pages: torch.Tensor) -> None:
        base = pages._base if pages._base is not None else pages
        with self._staging_lock:
            self._staging.setdefault(base.shape[1], []).append(base)

    def _deliver(self, layer: int, pages: torch.Tensor, done: torch.cuda.Event | None,
                 spans: list[tuple[str, int, int, int]],
                 deliver: Callable[[str, list[worker_pb2.KVPages]], None]) -> None:
        try:
            if done is not None:
                done.synchronize()
            for req_id, first_block, start, num_blocks in spans:
                k, v = pages[0, start:start + num_blocks], pages[1, start:start + num_blocks]
                deliver(req_id, list(pages_to_messages(layer, k, v, first_block=first_block)))
        except Exception:  # the request's stream then ends without these pages: the receiver sees a short transfer
            log.exception("exporting KV pages of layer %d failed", layer)
        finally:
            if done is not None:
                self._give_back(pages)

"""KV pages over gRPC: the layout check, tensors ↔ `KVPages` messages (raw bytes + CRC32).

Pages travel as raw little-endian tensor bytes (no per-element protobuf encoding), chunked by blocks
so that each message stays well under the channel's message-size limit.

A prompt of Llama-3.1-8B's shape is 128 MiB of pages per 1,024 tokens, and every copy of it made while holding
the GIL keeps the engine thread of the same process from launching kernels. So the prefill stream's pages are
written in the protobuf wire format here (`pages_to_wire`: a serialized `PrefillResponse` whose k and v are
copied, or gathered from the pool, straight into the message's bytes with the GIL released), sent as they are,
and read back as views of the received message (`parse_prefill_response`), where building `KVPages` messages,
wrapping them and serializing them would copy the bytes four times under the GIL. gRPC's own copy into its send
buffer is the one left.

The checksum is zlib's CRC-32, computed by ISA-L (`isal`): the same values as `zlib.crc32`, at 19-30 GB/s against
zlib's 1.4-3 GB/s on the 2-core VM, with the GIL released as zlib does. At zlib's speed it was the largest single
cost of the transport (a pass over every byte on each side).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from isal.isal_zlib import crc32

from tandem.common.config import KVLayout
from tandem.common.errors import LayoutMismatchError
from tandem.engine.kv_cache import as_bytes
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

# Each KVPages message carries at most this many bytes of K plus V. Kept small so that gRPC's copy of a message
# into its send buffer (made holding the GIL) keeps the engine thread waiting only briefly.
MAX_CHUNK_BYTES = 1024 * 1024
# The GIL switch interval (s) of a process that exports pages: the exporter thread's Python (its copies release the
# GIL) would otherwise keep the engine thread from launching the next layer's kernels for up to Python's default
# 5 ms at a time.
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
    them is the request's block number `first_block` (a prompt computed in chunks ships its blocks as they fill).
    The plain protobuf form of what `pages_to_wire` writes (which the prefill stream sends)."""
    num_blocks = k.shape[0]
    block_bytes = 2 * k[0].numel() * k.element_size()
    per_chunk = max(1, max_chunk_bytes // block_bytes)
    for start in range(0, num_blocks, per_chunk):
        k_bytes = _raw_bytes(k[start:start + per_chunk])
        v_bytes = _raw_bytes(v[start:start + per_chunk])
        yield worker_pb2.KVPages(layer=layer, block_start=first_block + start,
                                 num_blocks=min(per_chunk, num_blocks - start),
                                 k=k_bytes, v=v_bytes, crc32=crc32(v_bytes, crc32(k_bytes)))


# Field numbers of the wire format written and read here (from the descriptors, so a renumbering cannot slip by).
_RESPONSE_PAGES = worker_pb2.PrefillResponse.DESCRIPTOR.fields_by_name["pages"].number
_PAGES_FIELDS = {f.name: f.number for f in worker_pb2.KVPages.DESCRIPTOR.fields}
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5  # protobuf wire types
# The wire type of each KVPages field (a field of another wire type is unknown to protobuf, not that field).
_PAGES_WIRE_TYPES = {number: _LEN if name in ("k", "v") else _FIXED32 if name == "crc32" else _VARINT
                     for name, number in _PAGES_FIELDS.items()}
# The prefill stream, called with `parse_prefill_response` as its deserializer.
PREFILL_METHOD = f"/{worker_pb2.DESCRIPTOR.services_by_name['Prefill'].full_name}/Prefill"


@dataclass(frozen=True)
class WirePages:
    """One chunk of one layer's pages as a serialized `PrefillResponse` (`data`), which the prefill stream sends
    as it is."""

    layer: int
    block_start: int
    num_blocks: int
    data: bytes


@dataclass(frozen=True)
class PagesView:
    """A received `KVPages` message whose `k` and `v` are views of the message's bytes (no copy)."""

    layer: int
    block_start: int
    num_blocks: int
    k: memoryview
    v: memoryview
    crc32: int


class _Pages(Protocol):  # KVPages or PagesView
    @property
    def layer(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def k(self) -> bytes | memoryview: ...
    @property
    def v(self) -> bytes | memoryview: ...
    @property
    def crc32(self) -> int: ...


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_prefix(field: int, length: int) -> bytes:
    return _varint(field << 3 | _LEN) + _varint(length)


def _as_rows(t: torch.Tensor) -> np.ndarray:
    """Pages [blocks, block_size, Hkv, D] on the CPU as a uint8 array [blocks, bytes per block] (no copy): numpy
    has no bfloat16 or float8, and its copies are plain memcpys."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy()


def _writable(data: bytes) -> np.ndarray:
    """`data`, a bytes object this module has just made and nobody else has seen (not hashed, not shared), as a
    writable uint8 array: it is filled in place, as CPython itself fills a new bytes object."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8).numpy()


def pages_to_wire(layer: int, k: torch.Tensor, v: torch.Tensor, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                  first_block: int = 0, rows: torch.Tensor | None = None) -> Iterator[WirePages]:
    """`pages_to_messages`, each message already wrapped in a `PrefillResponse` and serialized. `rows` (int64,
    on the CPU), when given, picks the pages: k[rows] and v[rows], gathered from a pool straight into the
    messages. Each byte is copied once, into the message, by numpy with the GIL released (one thread: torch's
    copies of a MiB wake a team of OpenMP threads, which stalls when a core is busy), and the CRC-32 is computed
    over the message's own k and v afterwards, without the GIL too; `crc32` is a fixed32, so the small fields,
    written first, have their size before it is known. Protobuf reads fields in any order."""
    k_rows, v_rows = _as_rows(k), _as_rows(v)
    index = None if rows is None else rows.numpy()
    num_blocks = k.shape[0] if index is None else len(index)
    row_bytes = k_rows.shape[1]
    per_chunk = max(1, max_chunk_bytes // (2 * row_bytes))
    for start in range(0, num_blocks, per_chunk):
        count = min(per_chunk, num_blocks - start)
        size = count * row_bytes
        # A placeholder CRC, so that the field is written (a proto3 zero is not); its 4 bytes end the head.
        head = worker_pb2.KVPages(layer=layer, block_start=first_block + start, num_blocks=count,
                                  crc32=1).SerializeToString()
        k_prefix, v_prefix = _len_prefix(_PAGES_FIELDS["k"], size), _len_prefix(_PAGES_FIELDS["v"], size)
        inner = len(head) + len(k_prefix) + size + len(v_prefix) + size
        prefix = _len_prefix(_RESPONSE_PAGES, inner) + head + k_prefix
        data = bytes(len(prefix) + size + len(v_prefix) + size)
        out = _writable(data)
        k_at = len(prefix)
        v_at = k_at + size + len(v_prefix)
        out[:k_at] = np.frombuffer(prefix, dtype=np.uint8)
        out[k_at + size:v_at] = np.frombuffer(v_prefix, dtype=np.uint8)
        k_out, v_out = out[k_at:k_at + size], out[v_at:v_at + size]
        if index is None:
            np.copyto(k_out.reshape(count, row_bytes), k_rows[start:start + count])
            np.copyto(v_out.reshape(count, row_bytes), v_rows[start:start + count])
        else:
            # mode "clip": "raise" would gather into a temporary and copy that (the rows are the pool's own ids).
            np.take(k_rows, index[start:start + count], axis=0, out=k_out.reshape(count, row_bytes), mode="clip")
            np.take(v_rows, index[start:start + count], axis=0, out=v_out.reshape(count, row_bytes), mode="clip")
        crc = crc32(v_out, crc32(k_out))
        out[k_at - len(k_prefix) - 4:k_at - len(k_prefix)] = np.frombuffer(crc.to_bytes(4, "little"), np.uint8)
        yield WirePages(layer, first_block + start, count, data)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _wire_fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of one message; a length-delimited value is a view."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, kind = key >> 3, key & 7
        if not 0 < field < 1 << 29:
            raise ValueError(f"field number {field}")
        value: int | memoryview
        if kind == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif kind == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("a truncated field")
            value, pos = buf[pos:pos + length], pos + length
        elif kind in (_FIXED64, _FIXED32):
            size = 8 if kind == _FIXED64 else 4
            if pos + size > len(buf):
                raise ValueError("a truncated field")
            value, pos = int.from_bytes(buf[pos:pos + size], "little"), pos + size
        else:
            raise ValueError(f"wire type {kind}")
        yield field, kind, value


def parse_prefill_response(data: bytes) -> worker_pb2.PrefillResponse | PagesView:
    """The prefill stream's deserializer: a pages message becomes a `PagesView` of `data` (its bytes are not
    copied); any other message, or one this reader does not take apart, is parsed by protobuf."""
    buf = memoryview(data)
    try:
        fields = list(_wire_fields(buf))
        if len(fields) == 1 and fields[0][:2] == (_RESPONSE_PAGES, _LEN):
            values: dict[int, int | memoryview] = {}
            for field, kind, value in _wire_fields(fields[0][2]):  # type: ignore[arg-type]
                if _PAGES_WIRE_TYPES.get(field, kind) != kind:
                    raise ValueError(f"field {field} of wire type {kind}")  # unknown to protobuf: its parser's call
                values[field] = value  # the last one wins, as protobuf's own parser does
            numbers = _PAGES_FIELDS
            k, v = values.get(numbers["k"], buf[:0]), values.get(numbers["v"], buf[:0])
            scalars = [values.get(numbers[name], 0) for name in ("layer", "block_start", "num_blocks", "crc32")]
            assert isinstance(k, memoryview) and isinstance(v, memoryview)
            layer, block_start, num_blocks, crc = (int(x) & 0xFFFFFFFF for x in scalars)  # type: ignore[arg-type]
            return PagesView(layer, block_start, num_blocks, k, v, crc)
    except ValueError:
        pass  # protobuf's parser says what is wrong with it
    return worker_pb2.PrefillResponse.FromString(data)


def serialize_prefill_response(response: worker_pb2.PrefillResponse | bytes) -> bytes:
    """The prefill stream's serializer: pages come serialized already (`WirePages.data`)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def page_bytes(message: _Pages, layout: KVLayout) -> int:
    """K plus V bytes a pages message carries (without reading its bytes fields: each read may copy them)."""
    return 2 * message.num_blocks * layout.block_bytes_per_layer


def messages_to_pages(message: _Pages, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the checksum and the size, and view the bytes as K and V tensors on the CPU (read-only views
    of the message's bytes: copy before writing into them)."""
    k_bytes, v_bytes = message.k, message.v  # each read of a KVPages bytes field may copy it: read once
    if crc32(v_bytes, crc32(k_bytes)) != message.crc32:
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
    this one's pages come down. The serialized messages (`pages_to_wire`) are made on one worker thread, in
    submission order, once the copy has landed. On a CPU the worker thread gathers the pages from the pool
    straight into the messages: later layers of the step do not write this layer, and a request's blocks are
    held until its stream has ended, after `flush` (a later chunk of its prompt may meanwhile fill more slots
    of its last block: slots past the chunk are unspecified on the wire, and the block is sent again, whole).
    `cache` is the pool, [layers, 2, blocks, block_size, kv_heads, head_dim].
    """

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        # One thread: four that made messages at once moved the bytes twice as fast but took the GIL from the engine
        # thread often enough to make the forward 2.9x the local one on the H200 (1.07x with one).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-export")
        # Pinned staging buffers by capacity in blocks (a power of two), handed back by the worker thread.
        self._staging: dict[int, list[torch.Tensor]] = {}
        self._staging_lock = threading.Lock()

    def begin_step(self, requests: list[tuple[str, int, list[int]]],
                   deliver: Callable[[str, list[WirePages]], None]) -> Callable[[int], None]:
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
            if self.stream is None:  # [2, pool blocks, bs, Hkv, D]: the worker gathers `index` from it
                self._worker.submit(self._deliver, layer, self.cache[layer], index, None, spans, deliver)
                return
            computed = torch.cuda.Event()
            computed.record()
            pages = self._take_staging(len(block_ids))  # [2, n, bs, Hkv, D]
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(computed)
                as_bytes(pages).copy_(as_bytes(self.cache[layer]).index_select(1, index), non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._worker.submit(self._deliver, layer, pages, None, done, spans, deliver)

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

    def _deliver(self, layer: int, pages: torch.Tensor, index: torch.Tensor | None, done: torch.cuda.Event | None,
                 spans: list[tuple[str, int, int, int]],
                 deliver: Callable[[str, list[WirePages]], None]) -> None:
        """`pages`: the step's pages of `layer` in span order (staging), or the pool's layer and the step's block
        `index` into it (on a CPU)."""
        try:
            if done is not None:
                done.synchronize()
            for req_id, first_block, start, num_blocks in spans:
                if index is None:
                    messages = pages_to_wire(layer, pages[0, start:start + num_blocks],
                                             pages[1, start:start + num_blocks], first_block=first_block)
                else:
                    messages = pages_to_wire(layer, pages[0], pages[1], first_block=first_block,
                                             rows=index[start:start + num_blocks])
                deliver(req_id, list(messages))
        except Exception:  # the request's stream then ends without these pages: the receiver sees a short transfer
            log.exception("exporting KV pages of layer %d failed", layer)
        finally:
            if done is not None:
                self._give_back(pages)

"""The cuda-ipc KV transport: a prefill worker stores pages straight into a decode worker's pool on the same
GPU (its forward stores each layer's K/V there too), through a CUDA IPC mapping of that pool opened once per peer.

Choice (decode side, per prefill peer): cuda-ipc when both pools live on the same GPU (equal UUIDs) and
the prefill worker manages to open the handle (a test open: containers without a shared IPC namespace
fail it); otherwise, or after such a failure, `grpc` (pages as bytes in the stream).
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from dataclasses import dataclass, fields

import torch

from tandem.common.config import KVLayout
from tandem.common.errors import PoolOpenError
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

GRPC, CUDA_IPC = "grpc", "cuda-ipc"


@functools.cache
def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" on the CPU): the same physical device has the same UUID in every process. (Remembered:
    every `Info` answer names it.)"""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def transports_of(device: torch.device) -> list[str]:
    return [GRPC, CUDA_IPC] if device.type == "cuda" else [GRPC]


def choose_transport(preference: str, my_uuid: str, peer_uuid: str, peer_transports: list[str],
                     peer_failed_ipc: bool) -> str:
    """`preference` is auto | grpc | cuda-ipc (forced: an error if impossible)."""
    possible = bool(my_uuid) and my_uuid == peer_uuid and CUDA_IPC in peer_transports and not peer_failed_ipc
    if preference == GRPC:
        return GRPC
    if preference == CUDA_IPC:
        if not possible:
            raise ValueError(f"kv transport cuda-ipc impossible with this peer (GPU {peer_uuid or 'none'} vs "
                             f"{my_uuid or 'none'}{', its open failed' if peer_failed_ipc else ''})")
        return CUDA_IPC
    return CUDA_IPC if possible else GRPC


# cudaIpcMemHandle_t and cudaIpcEventHandle_t are 64 opaque bytes (CUDA_IPC_HANDLE_SIZE).
IPC_HANDLE_SIZE = 64
# torch's caching allocator wraps a cudaMalloc block's handle as: a version byte (2 up to torch 2.12, 3 from 2.13),
# the type byte b"c" (SHAREABLE_CUDA_MALLOC), the 64-byte handle. Only that type is accepted: an expandable
# segment's handle (b"e") names file descriptors of another process, and such pools go by grpc instead.
_SHAREABLE_VERSIONS = (2, 3)
_SHAREABLE_CUDA_MALLOC = ord("c")
# torch names the shared-memory file of its IPC reference counters "/torch_<pid>_<random>_<counter>", and
# each file holds CUDA_IPC_REF_COUNTER_FILE_SIZE (10,000) counters.
_REF_COUNTER_HANDLE = re.compile(r"/torch_\d{1,10}_\d{1,20}_\d{1,20}")
_REF_COUNTER_SLOTS = 10_000


@dataclass(frozen=True)
class PoolHandle:
    """A CUDA IPC mapping of a KV pool as plain values (what torch's `_share_cuda_` returns), never a
    serialized object: the receiver checks every field before handing any of them to the CUDA driver."""

    gpu_uuid: str
    num_blocks: int
    memory_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def to_proto(self) -> worker_pb2.CudaIpcPool:
        return worker_pb2.CudaIpcPool(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, message: worker_pb2.CudaIpcPool) -> PoolHandle:
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})


@dataclass
class ExportedPool:
    """The decode side: one pool, its id and its IPC handle (made once)."""

    pool_id: str
    handle: PoolHandle

    @classmethod
    def of(cls, pool: torch.Tensor) -> ExportedPool:
        assert pool.is_cuda and pool.is_contiguous() and pool.storage_offset() == 0, "export the whole pool"
        (memory_handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         event_sync) = share_storage(pool.untyped_storage())
        # The pool lives as long as the worker, so the handle stays valid for every peer.
        handle = PoolHandle(gpu_uuid=gpu_uuid(pool.device), num_blocks=pool.shape[2], memory_handle=memory_handle,
                            storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle,
                            event_sync_required=event_sync)
        return cls(pool_id=uuid.uuid4().hex, handle=handle)


def check_pool_handle(handle: PoolHandle, layout: KVLayout, device: torch.device) -> None:
    """Raise PoolOpenError unless `handle` is well-formed for a pool of `layout` on `device`."""
    problems = []
    if device.type != "cuda" or handle.gpu_uuid != gpu_uuid(device):
        problems.append(f"gpu_uuid {handle.gpu_uuid!r} is not this worker's GPU")
    if handle.num_blocks < 1:
        problems.append("num_blocks must be >= 1")
    expected = handle.num_blocks * 2 * layout.num_layers * layout.block_bytes_per_layer
    if handle.storage_size_bytes != expected:
        problems.append(f"storage_size_bytes {handle.storage_size_bytes} != {expected} for {handle.num_blocks} "
                        "blocks of this layout")
    problems += storage_problems(handle.memory_handle, handle.storage_offset_bytes, handle.ref_counter_handle,
                                 handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)
    if problems:
        raise PoolOpenError("cuda-ipc: invalid pool handle (" + "; ".join(problems) + ")")


def storage_problems(memory_handle: bytes, storage_offset_bytes: int, ref_counter_handle: str,
                     ref_counter_offset: int, event_handle: bytes, event_sync_required: bool) -> list[str]:
    """What is wrong with the fields of a shared CUDA storage (`_share_cuda_`'s values) before any of them reaches
    the CUDA driver, each naming its field; empty when nothing is."""
    problems = []
    if not _is_cuda_malloc_handle(memory_handle):
        problems.append(f"memory_handle ({len(memory_handle)} bytes) is not a cudaMalloc block's IPC handle")
    if (event_handle or event_sync_required) and len(event_handle) != IPC_HANDLE_SIZE:
        problems.append(f"event_handle is {len(event_handle)} bytes, not {IPC_HANDLE_SIZE}")
    if storage_offset_bytes >= 1 << 48:
        problems.append(f"storage_offset_bytes {storage_offset_bytes} is out of range")
    if not _REF_COUNTER_HANDLE.fullmatch(ref_counter_handle):
        problems.append(f"ref_counter_handle {ref_counter_handle[:64]!r} is not a torch IPC counter file")
    if not 0 <= ref_counter_offset < _REF_COUNTER_SLOTS:
        problems.append(f"ref_counter_offset {ref_counter_offset} is out of range")
    return problems


def _is_cuda_malloc_handle(memory_handle: bytes) -> bool:
    """A raw cudaIpcMemHandle_t, or torch's versioned wrapping of one (see _SHAREABLE_VERSIONS)."""
    if len(memory_handle) == IPC_HANDLE_SIZE:
        return True
    return (len(memory_handle) == IPC_HANDLE_SIZE + 2 and memory_handle[0] in _SHAREABLE_VERSIONS
            and memory_handle[1] == _SHAREABLE_CUDA_MALLOC)


def share_storage(storage: torch.UntypedStorage) -> tuple[bytes, int, int, str, int, bytes, bool]:
    """A CUDA storage's IPC values: (memory_handle, storage_size_bytes, storage_offset_bytes, ref_counter_handle,
    ref_counter_offset, event_handle, event_sync_required). Raises RuntimeError where torch cannot share it."""
    (_, memory_handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return (memory_handle, size_bytes, offset_bytes, ref_handle.decode() if isinstance(ref_handle, bytes)
            else ref_handle, ref_offset, event_handle or b"", bool(event_sync))


def open_storage(device: torch.device, memory_handle: bytes, storage_size_bytes: int, storage_offset_bytes: int,
                 ref_counter_handle: str, ref_counter_offset: int, event_handle: bytes,
                 event_sync_required: bool) -> torch.UntypedStorage:
    """Map a peer's storage (its fields checked by `storage_problems` first). Raises RuntimeError if CUDA cannot."""
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(), memory_handle,
        storage_size_bytes, storage_offset_bytes, ref_counter_handle.encode(), ref_counter_offset,
        event_handle or None, event_sync_required)


def open_pool(handle: PoolHandle, layout: KVLayout, device: torch.device) -> torch.Tensor:
    """The prefill side: map a peer's pool, [L, 2, num_blocks, B, Hkv, D] in the layout's dtype, after
    checking the handle. Raises PoolOpenError when it is malformed or cannot be opened."""
    check_pool_handle(handle, layout, device)
    try:
        storage = open_storage(device, handle.memory_handle, handle.storage_size_bytes, handle.storage_offset_bytes,
                               handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
                               handle.event_sync_required)
    except RuntimeError as error:
        raise PoolOpenError(f"cuda-ipc: cannot open the peer's pool handle ({error})") from None
    dtype = getattr(torch, layout.dtype)
    shape = (layout.num_layers, 2, handle.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    numel = handle.storage_size_bytes // torch.empty(0, dtype=dtype).element_size()
    flat = torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))  # type: ignore[call-overload]
    return flat.view(shape)

"""The cuda-ipc KV transport: a prefill worker writes pages straight into a decode worker's pool on the
same GPU, through a CUDA IPC mapping of that pool opened once per peer.

Choice (decode side, per prefill peer): cuda-ipc when both pools live on the same GPU (equal UUIDs) and
the prefill worker manages to open the handle (a test open: containers without a shared IPC namespace
fail it); otherwise, or after such a failure, `grpc` (pages as bytes in the stream).
"""

from __future__ import annotations

import logging
import pickle
import uuid
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

GRPC, CUDA_IPC = "grpc", "cuda-ipc"


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" on the CPU): the same physical device has the same UUID in every process."""
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


@dataclass
class ExportedPool:
    """The decode side: one pool, its id and its IPC handle (made once)."""

    pool_id: str
    handle: bytes

    @classmethod
    def of(cls, pool: torch.Tensor) -> ExportedPool:
        from torch.multiprocessing.reductions import reduce_tensor

        # reduce_tensor gives (rebuild function, args) carrying the cudaIpcMemHandle of the storage; the
        # pool lives as long as the worker, so the handle stays valid for every peer.
        return cls(pool_id=uuid.uuid4().hex, handle=pickle.dumps(reduce_tensor(pool)))


def open_pool(handle: bytes) -> torch.Tensor:
    """The prefill side: map a peer's pool. Raises RuntimeError when the handle cannot be opened."""
    rebuild, args = pickle.loads(handle)  # noqa: S301 - from our own peer over the internal API
    return rebuild(*args)


def copy_layer(src: torch.Tensor, src_blocks: torch.Tensor, dst: torch.Tensor, dst_blocks: torch.Tensor,
               layer: int) -> None:
    """dst[layer, :, dst_blocks] = src[layer, :, src_blocks] for pools [L, 2, N, B, Hkv, D], on the
    current stream (the same one the forward runs on, so the pages are complete when copied)."""
    dst[layer].index_copy_(1, dst_blocks, src[layer].index_select(1, src_blocks))

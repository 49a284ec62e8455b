"""One copy of the weights per GPU: prefill workers map the weights of the decode worker beside them (CUDA IPC).

An 8B model's bf16 weights are 16 GB. A prefill and a decode worker on one GPU each loaded their own, and two prefill
workers beside a decode worker left it a third of an 80 GB card, ~8 GB of KV pages (~48 requests of 1,280 tokens
against 128 allowed: `benchmarks/results/README.md`, 2026-12-07 sixth session). With `tandem prefill --weights-from
ADDRESS` a prefill worker asks that decode worker for its weights' IPC handles (`Decode.Weights`), builds its model's
structure on the meta device (quantized projections included: `quantize_linears` runs on meta tensors) and puts a
mapping of the owner's tensor in place of every parameter and buffer, checked one by one against the structure
(names, dtypes, shapes, the structure's own strides, the view inside the storage the owner names, the storage
512-byte aligned as the CUDA allocator places blocks). Nothing is copied; the prefill worker's own memory is its
activations and its small pool. What is not checked (nothing from Python can read a CUDA allocation's extent) is that
the named storage lies inside the IPC allocation: like a KV pool's handle, the answer is trusted that far, and comes
only from a peer the internal token or mutual TLS admits (docs/security.md).

The weights are read-only after load in every role, so sharing needs no synchronization beyond the owner's event in
the handle (torch records one after the storage was last written). A mapped allocation is valid while its owner
lives: a prefill worker that maps a decode worker's weights shares its fate, as workers started together by `tandem
up` on one GPU do (it passes `--weights-from` only there, and stops prefill workers before decode workers). The
prefill worker watches its owner's process (or, where its pid is not visible, its health) and exits at once when it is
gone (`watch_owner`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from tandem.common.config import ModelConfig
from tandem.common.errors import PoolOpenError
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.quantization import quantize_linears
from tandem.kernels import Ops
from tandem.serving.kv_ipc import gpu_uuid, open_storage, share_storage, storage_problems
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# torch's CUDA caching allocator places every block at a multiple of this inside its segment.
ALLOCATION_ALIGNMENT = 512
# The dtypes a shared tensor may have (a model's weights, norms, quantized codes and scales).
_DTYPES = {name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", "int8", "float8_e4m3fn")}


# How long a prefill worker waits for the owner of the weights to answer (started together, the owner loads its
# weights, compiles and captures its graphs first: about a minute for an 8B model).
OWNER_STARTUP_S = 600.0
# A prefill worker whose weights' owner went away exits with this code (EX_SOFTWARE would hide it among bugs).
OWNER_GONE_EXIT_CODE = 75  # EX_TEMPFAIL: start it again once its owner is back


class WeightsShareError(PoolOpenError):
    """The weights cannot be shared or mapped (FAILED_PRECONDITION, as a pool that cannot be opened)."""


def weights_fingerprint(model: ModelConfig, dtype: torch.dtype) -> str:
    """Names exactly the weights a worker holds: the model (shapes, weights, quantization) and its dtype."""
    return f"{model.fingerprint()}:{str(dtype).removeprefix('torch.')}"


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model` by name (a tied tensor under each of its names)."""
    return [(name, tensor) for name, tensor in [*model.named_parameters(remove_duplicate=False),
                                                 *model.named_buffers(remove_duplicate=False)] if tensor is not None]


def export_weights(model: nn.Module, config: ModelConfig, dtype: torch.dtype) -> worker_pb2.WeightsResponse:
    """The owner's side: `model`'s tensors as IPC handles (one per storage, made anew for every asker: each share
    has its own count in torch's IPC reference counters). Raises WeightsShareError where they cannot be shared: not
    on a GPU, or in memory whose handle a mapper would refuse (expandable segments: `storage_problems`)."""
    tensors = named_tensors(model)
    device = tensors[0][1].device
    if device.type != "cuda":
        raise WeightsShareError(f"weights on {device} cannot be shared (CUDA IPC needs a GPU)")
    response = worker_pb2.WeightsResponse(gpu_uuid=gpu_uuid(device), fingerprint=weights_fingerprint(config, dtype),
                                          owner_pid=os.getpid())
    storages: dict[int, worker_pb2.CudaIpcStorage] = {}
    for name, tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        storage = storages.get(key)
        if storage is None:
            try:
                (memory_handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
                 event_sync) = share_storage(tensor.untyped_storage())
            except RuntimeError as error:
                raise WeightsShareError(f"cannot share {name} by CUDA IPC ({error})") from None
            if problems := storage_problems(memory_handle, offset_bytes, ref_handle, ref_offset, event_handle,
                                            event_sync):
                raise WeightsShareError(f"cannot share {name} by CUDA IPC ({'; '.join(problems)}; expandable "
                                        "segments in PYTORCH_CUDA_ALLOC_CONF give handles a peer cannot open)")
            storage = storages[key] = worker_pb2.CudaIpcStorage(
                memory_handle=memory_handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle,
                event_sync_required=event_sync)
        response.tensors.add(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=tensor.shape,
                             stride=tensor.stride(), storage_offset=tensor.storage_offset(), storage=storage)
    return response


def model_skeleton(config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model's modules on the meta device in `dtype`, projections quantized as `config` asks (their kernels
    picked for `device`): the names, dtypes and shapes a worker with this config holds, and no storage."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops).to(dtype)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        if config.quantization is not None:
            quantize_linears(model, config.quantization, device)
    return model


Opener = Callable[[worker_pb2.CudaIpcStorage], torch.UntypedStorage]


def map_weights(response: worker_pb2.WeightsResponse, config: ModelConfig, ops: Ops, dtype: torch.dtype,
                device: torch.device, opener: Opener | None = None) -> LlamaForCausalLM:
    """The mapper's side: the model of `config` with every tensor a view of the owner's (`response`). Everything is
    checked before anything is mapped; WeightsShareError names each problem. `opener` maps one storage (tests on the
    CPU pass their own; by default CUDA IPC on `device`)."""
    problems = []
    if response.gpu_uuid != gpu_uuid(device) or device.type != "cuda" and opener is None:
        problems.append(f"gpu_uuid {response.gpu_uuid!r} is not this worker's GPU")
    if response.fingerprint != weights_fingerprint(config, dtype):
        problems.append(f"fingerprint {response.fingerprint!r} is not this worker's model "
                        f"({weights_fingerprint(config, dtype)!r})")
    model = model_skeleton(config, ops, dtype, device)
    expected = dict(named_tensors(model))
    given = {t.name: t for t in response.tensors}
    if len(given) != len(response.tensors):
        problems.append("tensors: a name is listed twice")
    if missing := sorted(expected.keys() - given.keys()):
        problems.append(f"tensors: {len(missing)} missing, e.g. {missing[:3]}")
    if unexpected := sorted(given.keys() - expected.keys()):
        problems.append(f"tensors: {len(unexpected)} not in this model, e.g. {unexpected[:3]}")
    for name in sorted(expected.keys() & given.keys()):
        problems += _tensor_problems(given[name], expected[name])
    if problems:
        raise WeightsShareError("cannot map the shared weights (" + "; ".join(problems[:8]) + ")")
    open_one = opener or (lambda s: open_storage(device, s.memory_handle, s.storage_size_bytes,
                                                 s.storage_offset_bytes, s.ref_counter_handle, s.ref_counter_offset,
                                                 s.event_handle, s.event_sync_required))
    opened: dict[tuple[bytes, int], torch.UntypedStorage] = {}
    for name in expected:
        shared = given[name]
        key = (shared.storage.memory_handle, shared.storage.storage_offset_bytes)
        try:
            if key not in opened:
                opened[key] = open_one(shared.storage)
            tensor = torch.empty(0, dtype=_DTYPES[shared.dtype], device=opened[key].device)
            tensor.set_(opened[key], shared.storage_offset, tuple(shared.shape), tuple(shared.stride))  # type: ignore[call-overload]
        except (RuntimeError, TypeError, ValueError) as error:
            raise WeightsShareError(f"cannot map {name} ({type(error).__name__}: {error})") from None
        _put(model, name, tensor)
    return model.eval().requires_grad_(False)


def _tensor_problems(shared: worker_pb2.SharedTensor, expected: torch.Tensor) -> list[str]:
    name = shared.name
    if shared.dtype not in _DTYPES or _DTYPES[shared.dtype] != expected.dtype:
        return [f"{name}: dtype {shared.dtype!r}, expected {str(expected.dtype).removeprefix('torch.')}"]
    if tuple(shared.shape) != tuple(expected.shape):
        return [f"{name}: shape {list(shared.shape)}, expected {list(expected.shape)}"]
    if tuple(shared.stride) != tuple(expected.stride()):  # the owner built the same structure: the same layout
        return [f"{name}: stride {list(shared.stride)}, expected {list(expected.stride())}"]
    storage = shared.storage
    problems = [f"{name}: {p}" for p in storage_problems(
        storage.memory_handle, storage.storage_offset_bytes, storage.ref_counter_handle, storage.ref_counter_offset,
        storage.event_handle, storage.event_sync_required)]
    if storage.storage_offset_bytes % ALLOCATION_ALIGNMENT:
        problems.append(f"{name}: storage_offset_bytes {storage.storage_offset_bytes} is not a multiple of "
                        f"{ALLOCATION_ALIGNMENT}")
    # The view must lie inside its storage: its last element's offset, in bytes, below the storage's size.
    last = shared.storage_offset + sum((n - 1) * s for n, s in zip(shared.shape, shared.stride, strict=True))
    size = expected.element_size()
    if math.prod(shared.shape) and (last + 1) * size > storage.storage_size_bytes:
        problems.append(f"{name}: the view ends at byte {(last + 1) * size}, past its storage's "
                        f"{storage.storage_size_bytes}")
    return problems


def _put(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor


async def fetch_weights(channel: grpc.aio.Channel, timeout_s: float = OWNER_STARTUP_S) -> worker_pb2.WeightsResponse:
    """Ask the owner for its handles, retrying while it is not up yet (workers start together) until `timeout_s`."""
    stub = worker_pb2_grpc.DecodeStub(channel)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await stub.Weights(worker_pb2.WeightsRequest(), timeout=max(deadline - loop.time(), 1.0))
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or loop.time() > deadline:
                raise WeightsShareError(f"weights_from: {error.code().name}: {error.details()}") from None
        await asyncio.sleep(0.5)


async def watch_owner(channel: grpc.aio.Channel, owner_pid: int = 0, interval_s: float = 0.5,
                      health_timeout_s: float = 5.0, failures: int = 3) -> None:
    """Until the owner of the mapped weights is gone; then this process exits at once (no drain: its weights may no
    longer be valid memory, and nothing it computed could be trusted). Where the owner's process is visible
    (`owner_pid` in this host's /proc: the same pid namespace) its end, or its becoming a zombie, is what counts;
    elsewhere `failures` health checks in a row that find nobody answering (UNAVAILABLE, or no answer in
    `health_timeout_s`: a busy owner is not a dead one)."""
    if owner_pid and (identity := _process_start(owner_pid)) is not None:
        while _process_start(owner_pid) == identity:
            await asyncio.sleep(interval_s)
        _owner_gone()
    stub = health_pb2_grpc.HealthStub(channel)
    missed = 0
    while True:
        await asyncio.sleep(interval_s)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=health_timeout_s)
            missed = 0
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                missed = 0
                continue
            missed += 1
            if missed >= failures:
                _owner_gone()


def _process_start(pid: int) -> int | None:
    """The start time of a live process `pid` (from /proc: a pid reused by another process has another), or None
    when it is gone, a zombie, or not visible here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _owner_gone() -> None:
    log.error("the worker whose weights this one maps is gone: exiting")
    logging.shutdown()
    os._exit(OWNER_GONE_EXIT_CODE)

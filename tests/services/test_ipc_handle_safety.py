"""The cuda-ipc pool handle is plain, validated data: nothing from the network is ever unpickled."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.internal import encoder

from tandem import SamplingParams
from tandem.common.config import KVLayout
from tandem.common.errors import KVTransportError
from tandem.serving.kv_ipc import IPC_HANDLE_SIZE, PoolHandle, check_pool_handle
from tandem.serving.rpc import make_channel
from tandem.serving.wire import layout_to_proto, sampling_to_worker
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.services.test_disaggregated import Worker

LAYOUT = KVLayout(dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, model_fingerprint="x")


class _WritesAFile:
    """Unpickling this creates a file: proof of code execution if it ever happens."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (os.system, (f"touch {self.path}",))


def _good_handle() -> PoolHandle:
    size = 4 * 2 * LAYOUT.num_layers * LAYOUT.block_bytes_per_layer
    return PoolHandle(gpu_uuid="GPU-0", num_blocks=4, memory_handle=b"\0" * IPC_HANDLE_SIZE, storage_size_bytes=size,
                      storage_offset_bytes=0, ref_counter_handle="/torch_12_34_0", ref_counter_offset=3,
                      event_handle=b"", event_sync_required=False)


def test_handle_fields_are_checked_and_named() -> None:
    bad = PoolHandle(gpu_uuid="GPU-other", num_blocks=4, memory_handle=pickle.dumps("x"), storage_size_bytes=1 << 40,
                     storage_offset_bytes=1 << 60, ref_counter_handle="/etc/passwd", ref_counter_offset=10**9,
                     event_handle=b"short", event_sync_required=True)
    with pytest.raises(KVTransportError) as caught:
        check_pool_handle(bad, LAYOUT, torch.device("cpu"))
    message = str(caught.value)
    for name in ("gpu_uuid", "memory_handle", "event_handle", "storage_size_bytes", "storage_offset_bytes",
                 "ref_counter_handle", "ref_counter_offset"):
        assert name in message, (name, message)


def test_torch_wrapped_cuda_malloc_handles_are_accepted_and_others_not() -> None:
    """torch wraps the 64-byte handle as version byte + b"c" + handle (seen on an H200 with torch 2.11: the
    strict 64-byte check refused every real pool); an expandable segment's b"e" handle is refused."""
    good = _good_handle()
    layout_ok = LAYOUT
    for memory_handle, accepted in ((b"\2c" + b"\0" * 64, True), (b"\3c" + b"\0" * 64, True),
                                    (b"\0" * 64, True), (b"\2e" + b"\0" * 64, False),
                                    (rb"\9c" + b"\0" * 64, False), (b"\2c" + b"\0" * 63, False)):
        handle = PoolHandle(**{**good.__dict__, "memory_handle": memory_handle})
        with pytest.raises(KVTransportError) as caught:
            check_pool_handle(handle, layout_ok, torch.device("cpu"))  # the CPU fails the GPU check in any case
        assert ("memory_handle" in str(caught.value)) == (not accepted), memory_handle[:2]


def test_handle_round_trips_through_its_message() -> None:
    handle = _good_handle()
    assert PoolHandle.from_proto(handle.to_proto()) == handle


async def test_pickled_handle_of_the_old_api_runs_nothing(workers: tuple[Worker, Worker], tmp_path: Path) -> None:
    """The old `KVTarget.pool_handle` (field 2) carried pickle bytes; a caller sending them now is ignored
    (an unknown field), and a hostile handle in the new field is refused before it reaches CUDA."""
    prefill, decode = workers
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_WritesAFile(str(marker)))
    layout = decode.engine.engine.layout
    target = worker_pb2.KVTarget(pool_id="p", block_ids=[0])
    # Field 2 as raw wire bytes, exactly what the old API accepted and unpickled.
    raw_field_2 = encoder.TagBytes(2, 2) + encoder._VarintBytes(len(payload)) + payload
    target.MergeFromString(raw_field_2)
    request = worker_pb2.PrefillRequest(
        request_id="evil-1", prompt_token_ids=[1, 2, 3],
        sampling=sampling_to_worker(SamplingParams(max_tokens=1, seed=0)), layout=layout_to_proto(layout),
        target=target)
    stub = worker_pb2_grpc.PrefillStub(make_channel(prefill.address))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Prefill(request):
            pass
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown pool" in (caught.value.details() or "")

    # The new field with garbage: refused by validation, naming what is wrong.
    request.target.pool.CopyFrom(worker_pb2.CudaIpcPool(gpu_uuid="GPU-x", num_blocks=1, memory_handle=payload,
                                                        ref_counter_handle="/dev/shm/../../etc/passwd"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Prefill(request):
            pass
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "invalid pool handle" in (caught.value.details() or "")
    assert not marker.exists()


async def test_a_cpu_decode_worker_refuses_to_share_its_weights_and_the_prefill_side_says_why(workers) -> None:  # noqa: ANN001
    """`Decode.Weights` on a worker without a GPU: FAILED_PRECONDITION naming why, and a prefill worker asked to map
    them (`fetch_weights`) fails with that, not a retry loop."""
    from tandem.serving.weight_ipc import WeightsShareError, fetch_weights

    _, decode = workers
    async with make_channel(decode.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await worker_pb2_grpc.DecodeStub(channel).Weights(worker_pb2.WeightsRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "needs a GPU" in (caught.value.details() or "")
        with pytest.raises(WeightsShareError, match="FAILED_PRECONDITION.*needs a GPU"):
            await fetch_weights(channel, timeout_s=10)


async def test_tandem_prefill_says_why_it_cannot_map_weights_and_exits(workers) -> None:  # noqa: ANN001
    """`tandem prefill --weights-from` a worker that cannot share: one line naming the flag and the cause, exit 2."""
    import asyncio
    import sys

    from tandem.launcher import free_port

    _, decode = workers
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.cli", "prefill", "--model", "dummy:tiny", "--port", str(free_port("127.0.0.1")),
        "--http-port", str(free_port("127.0.0.1")), "--weights-from", decode.address,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 2
    assert f"--weights-from {decode.address}" in stderr.decode() and "needs a GPU" in stderr.decode()
    assert "Traceback" not in stderr.decode()

"""Weights mapped from a peer (`tandem.serving.weight_ipc`): the mapped model is the owner's tensors, nothing copied,
and gives the owner's logits; every malformed or foreign description is refused before anything is mapped, each
problem named; a mapper exits when its owner's process ends. On the CPU the storages are "opened" as slices of one
stand-in segment holding the owner's (CUDA IPC itself needs a GPU: tests/e2e/test_gpu_stack.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.common.config import EngineConfig, ModelConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.runner import ModelRunner
from tandem.engine.weights import build_model, load_weights
from tandem.kernels import get_ops
from tandem.models import load_model_config
from tandem.serving.weight_ipc import (
    WeightsShareError,
    export_weights,
    map_weights,
    named_tensors,
    weights_fingerprint,
)
from tandem.v1 import worker_pb2

OPS = get_ops("torch")


def owner(config: ModelConfig, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = build_model(config, OPS, dtype, torch.device("cpu"))
    load_weights(model, config)
    return model.eval().requires_grad_(False)


SEGMENT = bytes([3, ord("c")]) + bytes(64)  # one stand-in cudaMalloc segment holds every tensor, as on a GPU


def describe(model: LlamaForCausalLM, config: ModelConfig, dtype: torch.dtype
             ) -> tuple[worker_pb2.WeightsResponse, torch.UntypedStorage]:
    """What `export_weights` answers on a GPU, for CPU tensors: the owner's storages are moved into one "segment" at
    512-byte aligned offsets (the owner's tensors then live there), each named by that segment's stand-in handle and
    its offset; returns the segment the test's opener maps them from."""
    tensors = named_tensors(model)
    storages: dict[int, torch.UntypedStorage] = {}
    for _, tensor in tensors:
        storages.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage())
    offsets, end = {}, 0
    for key, storage in storages.items():
        offsets[key] = end
        end += -(-storage.nbytes() // 512) * 512
    segment = torch.zeros(end, dtype=torch.uint8).untyped_storage()
    for key, storage in storages.items():
        segment[offsets[key]:offsets[key] + storage.nbytes()].copy_(storage)
    response = worker_pb2.WeightsResponse(gpu_uuid="", fingerprint=weights_fingerprint(config, dtype))
    for name, tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        size = storages[key].nbytes()
        response.tensors.add(
            name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=tensor.shape, stride=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            storage=worker_pb2.CudaIpcStorage(memory_handle=SEGMENT, storage_size_bytes=size,
                                              storage_offset_bytes=offsets[key], ref_counter_handle="/torch_1_2_3",
                                              ref_counter_offset=0))
    keys = {id(tensor): tensor.untyped_storage().data_ptr() for _, tensor in tensors}
    for tensor in {id(t): t for _, t in tensors}.values():  # the owner now uses the segment's copy (tied: once)
        key = keys[id(tensor)]
        with torch.no_grad():
            tensor.set_(segment[offsets[key]:offsets[key] + storages[key].nbytes()], tensor.storage_offset(),
                        tensor.shape, tensor.stride())
    return response, segment


def opener(segment: torch.UntypedStorage):  # noqa: ANN201
    """Maps a storage as `_new_shared_cuda` does: the segment's bytes from the storage's offset, of its size."""
    def open_one(storage: worker_pb2.CudaIpcStorage) -> torch.UntypedStorage:
        assert storage.memory_handle == SEGMENT
        return segment[storage.storage_offset_bytes:storage.storage_offset_bytes + storage.storage_size_bytes]
    return open_one


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_mapped_model_is_the_owners_tensors_and_gives_its_logits(quantization: str | None) -> None:
    config = dataclasses.replace(load_model_config("dummy:tiny", fetch=False), quantization=quantization)
    source = owner(config)
    reference = {name: tensor.clone() for name, tensor in named_tensors(source)}
    response, segment = describe(source, config, torch.float32)
    mapped = map_weights(response, config, OPS, torch.float32, torch.device("cpu"), opener(segment))
    theirs = dict(named_tensors(source))
    mine = dict(named_tensors(mapped))
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert tensor.data_ptr() == theirs[name].data_ptr(), name  # the same memory: nothing copied
        assert torch.equal(tensor, reference[name]), name  # the owner's values, found at their offsets
        assert tensor.dtype == theirs[name].dtype and tensor.shape == theirs[name].shape
    if config.tie_word_embeddings:
        assert mapped.lm_head.weight is mapped.model.embed_tokens.weight or \
            mapped.lm_head.weight.data_ptr() == mapped.model.embed_tokens.weight.data_ptr()
    # An engine over the mapped model generates what one over the owner's does (same tokens, same logprobs).
    engine_config = EngineConfig.create(config, device="cpu", num_kv_blocks=32, max_model_len=64, dtype="float32")
    outputs = [generate(Engine(engine_config, ModelRunner(engine_config, OPS, model=model)))
               for model in (source, mapped)]
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 8


def generate(engine: Engine) -> tuple[list[int], list[float]]:
    engine.add_request("r", [1, 5, 9, 200, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    request = engine.requests["r"]
    while engine.has_unfinished():
        engine.step()
    return list(request.output_token_ids), list(request.output_logprobs)


def test_a_foreign_or_malformed_description_is_refused_naming_each_problem() -> None:
    config = load_model_config("dummy:tiny", fetch=False)
    source = owner(config)
    good, segment = describe(source, config, torch.float32)
    cpu = torch.device("cpu")

    def refused(response: worker_pb2.WeightsResponse, *, dtype: torch.dtype = torch.float32,
                model: ModelConfig = config) -> str:
        with pytest.raises(WeightsShareError) as error:
            map_weights(response, model, OPS, dtype, cpu, opener(segment))
        return str(error.value)

    other = dataclasses.replace(config, dummy_seed=1)
    assert "fingerprint" in refused(good, model=other)
    assert "fingerprint" in refused(good, dtype=torch.bfloat16)
    first = good.tensors[0].name

    def changed(edit) -> worker_pb2.WeightsResponse:  # noqa: ANN001
        response = worker_pb2.WeightsResponse()
        response.CopyFrom(good)
        edit(response.tensors[0])
        return response

    assert f"{first}: shape" in refused(changed(lambda t: t.shape.__setitem__(0, t.shape[0] + 1)))
    assert f"{first}: dtype 'int8'" in refused(changed(lambda t: setattr(t, "dtype", "int8")))
    assert f"{first}: dtype 'complex64'" in refused(changed(lambda t: setattr(t, "dtype", "complex64")))
    assert "past its storage" in refused(changed(lambda t: setattr(t, "storage_offset", 10**6)))
    assert "memory_handle" in refused(changed(lambda t: setattr(t.storage, "memory_handle", b"x" * 10)))
    assert "ref_counter_handle" in refused(changed(lambda t: setattr(t.storage, "ref_counter_handle", "/etc/passwd")))
    assert f"{first}: stride" in refused(changed(lambda t: t.stride.append(1)))
    assert f"{first}: stride" in refused(changed(lambda t: t.stride.__setitem__(0, 0)))  # a broadcast view
    assert "not a multiple of 512" in refused(changed(lambda t: setattr(t.storage, "storage_offset_bytes", 8)))
    missing = worker_pb2.WeightsResponse()
    missing.CopyFrom(good)
    del missing.tensors[0]
    assert "1 missing" in refused(missing)
    extra = worker_pb2.WeightsResponse()
    extra.CopyFrom(good)
    extra.tensors.add().CopyFrom(good.tensors[0])
    extra.tensors[-1].name = "model.layers.99.secret"
    message = refused(extra)
    assert "not in this model" in message and "model.layers.99.secret" in message
    elsewhere = worker_pb2.WeightsResponse()
    elsewhere.CopyFrom(good)
    elsewhere.gpu_uuid = "GPU-1234"
    assert "gpu_uuid" in refused(elsewhere)


def test_weights_on_the_cpu_cannot_be_exported() -> None:
    config = load_model_config("dummy:tiny", fetch=False)
    with pytest.raises(WeightsShareError, match="needs a GPU"):
        export_weights(owner(config), config, torch.float32)


def test_a_mapper_exits_when_the_owners_process_ends() -> None:
    """`watch_owner` with the owner's pid: the watcher's process ends with OWNER_GONE_EXIT_CODE soon after the owner's
    (run in a child process: the watcher exits the process it runs in)."""
    import subprocess
    import sys
    import time

    from tandem.serving.weight_ipc import OWNER_GONE_EXIT_CODE

    owner_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    watcher = subprocess.Popen([sys.executable, "-c", f"""
import asyncio
from tandem.serving.rpc import make_channel
from tandem.serving.weight_ipc import watch_owner
async def main():
    await watch_owner(make_channel("127.0.0.1:1"), {owner_process.pid}, interval_s=0.05)
asyncio.run(main())
"""])
    started = time.monotonic()
    assert watcher.wait(timeout=30) == OWNER_GONE_EXIT_CODE
    assert owner_process.wait(timeout=5) == 0
    assert time.monotonic() - started >= 1.0  # it waited for the owner, not for nothing

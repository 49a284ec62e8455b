"""Weights mapped from a peer (`tandem.serving.weight_ipc`): the mapped model is the owner's tensors, nothing copied,
and gives the owner's logits; every malformed or foreign description is refused before anything is mapped, each
problem named. On the CPU the storages are "opened" from a table of the owner's (CUDA IPC itself needs a GPU:
tests/services/test_shared_weights_gpu.py)."""

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


def describe(model: LlamaForCausalLM, config: ModelConfig, dtype: torch.dtype
             ) -> tuple[worker_pb2.WeightsResponse, dict[bytes, torch.UntypedStorage]]:
    """What `export_weights` answers on a GPU, for CPU tensors: each storage gets a well-formed stand-in handle, and
    the table the test's opener maps handles back with."""
    response = worker_pb2.WeightsResponse(gpu_uuid="", fingerprint=weights_fingerprint(config, dtype))
    table: dict[bytes, torch.UntypedStorage] = {}
    handles: dict[int, bytes] = {}
    for name, tensor in named_tensors(model):
        storage = tensor.untyped_storage()
        handle = handles.setdefault(storage.data_ptr(), bytes([3, ord("c")]) + len(handles).to_bytes(64, "little"))
        table[handle] = storage
        response.tensors.add(
            name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=tensor.shape, stride=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            storage=worker_pb2.CudaIpcStorage(memory_handle=handle, storage_size_bytes=storage.nbytes(),
                                              ref_counter_handle="/torch_1_2_3", ref_counter_offset=0))
    return response, table


def opener(table: dict[bytes, torch.UntypedStorage]):  # noqa: ANN201
    return lambda storage: table[storage.memory_handle]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_mapped_model_is_the_owners_tensors_and_gives_its_logits(quantization: str | None) -> None:
    config = dataclasses.replace(load_model_config("dummy:tiny", fetch=False), quantization=quantization)
    source = owner(config)
    response, table = describe(source, config, torch.float32)
    mapped = map_weights(response, config, OPS, torch.float32, torch.device("cpu"), opener(table))
    theirs = dict(named_tensors(source))
    mine = dict(named_tensors(mapped))
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert tensor.data_ptr() == theirs[name].data_ptr(), name  # the same memory: nothing copied
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
    good, table = describe(source, config, torch.float32)
    cpu = torch.device("cpu")

    def refused(response: worker_pb2.WeightsResponse, *, dtype: torch.dtype = torch.float32,
                model: ModelConfig = config) -> str:
        with pytest.raises(WeightsShareError) as error:
            map_weights(response, model, OPS, dtype, cpu, opener(table))
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
    assert "strides" in refused(changed(lambda t: t.stride.append(1)))
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

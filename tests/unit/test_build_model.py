"""The model is built in its dtype on its device (`build_model`): no float32 copy first, the same weights as building
in float32 and casting, tied embeddings still tied, and a checkpoint that leaves a parameter out is refused (nothing
is left uninitialised)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from tandem.common.config import ConfigError
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.weights import _shard_offsets, build_model, load_weights
from tandem.kernels import get_ops
from tandem.models import load_model_config


def test_build_model_gives_the_weights_of_a_float32_build_cast() -> None:
    config = load_model_config("dummy:tiny")
    ops = get_ops("torch")
    built = build_model(config, ops, torch.bfloat16, torch.device("cpu"))
    load_weights(built, config)
    cast = LlamaForCausalLM(config, ops).to(torch.bfloat16)  # the former way
    load_weights(cast, config)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    assert built.state_dict().keys() == cast.state_dict().keys()
    for name, tensor in built.state_dict().items():
        assert torch.equal(tensor, cast.state_dict()[name]), name
    assert built.lm_head.weight is built.model.embed_tokens.weight  # dummy:tiny ties them


def test_build_model_does_not_tie_what_the_config_does_not() -> None:
    config = replace(load_model_config("dummy:tiny"), tie_word_embeddings=False)
    model = build_model(config, get_ops("torch"), torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_a_checkpoint_missing_a_tensor_is_refused(tmp_path) -> None:
    config = load_model_config("dummy:tiny")
    source = LlamaForCausalLM(config, get_ops("torch"))
    load_weights(source, config)
    tensors = {}  # in HF's names: the merged projections split again
    for name, tensor in source.state_dict().items():
        for merged, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{merged}." in name:
                offsets = _shard_offsets(config, merged)
                for i, part in enumerate(parts):
                    tensors[name.replace(merged, part)] = tensor[offsets[i]:offsets[i + 1]].contiguous()
                break
        else:
            tensors[name] = tensor.contiguous()
    del tensors["lm_head.weight"]  # tied
    save_file(tensors, str(tmp_path / "model.safetensors"))
    complete = build_model(config, get_ops("torch"), torch.float32, torch.device("cpu"))
    load_weights(complete, replace(config, weights_path=str(tmp_path)))
    assert all(torch.equal(t, source.state_dict()[n]) for n, t in complete.state_dict().items())
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="weights_path: checkpoint lacks 1 tensors"):
        load_weights(build_model(config, get_ops("torch"), torch.float32, torch.device("cpu")),
                     replace(config, weights_path=str(tmp_path)))


_PEAK = """
import resource, torch
from tandem.engine.weights import _shard_offsets, build_model, load_weights
from tandem.kernels import get_ops
from tandem.models import load_model_config
config = load_model_config("dummy:smollm2-135m")
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = rss()
model = build_model(config, get_ops("torch"), torch.bfloat16, torch.device("cpu"))
load_weights(model, config)
print(rss() - before, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def test_building_in_bfloat16_never_holds_a_float32_copy() -> None:
    """135M parameters: 270 MB in bfloat16, where a float32 build would first take 540 MB more, which the peak RSS
    (every page the process ever touched) shows: measured 1.27x the weights' bytes, 2.41x with a float32 build."""
    grown, weight_bytes = map(int, subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True,
                                                  check=True).stdout.split())
    assert weight_bytes > 250e6
    assert grown < 1.75 * weight_bytes, (grown, weight_bytes)


def test_packed_linears_hold_their_weights_once_and_compute_the_same() -> None:
    """On the CPU the fp32 linears go through oneDNN with prepacked weights (`pack_linears`): each keeps only the
    packed copy (its weight an empty placeholder), except a weight another module shares (the tied head: the
    embedding table), and every output matches the plain product."""
    from tandem.kernels.cpu_linear import onednn_linear_available, pack_linears

    if not onednn_linear_available():
        pytest.skip("needs torch with oneDNN (mkldnn)")
    config = load_model_config("dummy:tiny")
    model = build_model(config, get_ops("torch"), torch.float32, torch.device("cpu"))
    load_weights(model, config)
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    weights = {name: m.weight.detach().clone() for name, m in linears.items()}
    assert pack_linears(model) == len(linears)
    x = torch.randn(3, config.hidden_size)
    for name, linear in linears.items():
        if name == "lm_head":  # tied: still the embedding table's tensor
            assert linear.weight is model.model.embed_tokens.weight and linear.weight.numel() > 0
        else:
            assert linear.weight.numel() == 0 and linear.weight.dtype == torch.float32
        inputs = x if linear.in_features == config.hidden_size else torch.randn(3, linear.in_features)
        torch.testing.assert_close(linear(inputs), inputs @ weights[name].T, rtol=1e-4, atol=1e-5)

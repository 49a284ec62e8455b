"""Build a `LlamaForCausalLM` in its dtype on its device and fill it with weights: an HF safetensors folder, or
seeded random ("dummy") ones; then quantize its projections when the config asks for it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tandem.common.config import ConfigError, ModelConfig
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.quantization import quantize_linears
from tandem.kernels import Ops

# HF name fragment → (merged parameter fragment, shard index). Shards are stacked along dim 0 in
# this order, which is the order `LlamaAttention.split_sizes` and `silu_and_mul` expect.
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _shard_offsets(config: ModelConfig, merged: str) -> list[int]:
    if merged == "qkv_proj":
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return [0, q, q + kv, q + 2 * kv]
    inter = config.intermediate_size
    return [0, inter, 2 * inter]


def build_model(config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model's modules with uninitialised storage of `dtype` on `device`, for `load_weights` to fill (it covers
    every parameter, or fails). Built on the meta device: no float32 copy and no initialiser run first (on a 2-core
    CPU, 1B parameters took 13 s to initialise and 1.7 s to cast, for values the weights then overwrite)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # `to_empty` gives every reference its own storage: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_weights(model: LlamaForCausalLM, config: ModelConfig) -> None:
    """Copy every tensor of the checkpoint into the model (every parameter must be covered), or random ones for a
    dummy model; then, with `config.quantization`, replace the projections by quantized ones."""
    if config.weights_path is None:
        init_dummy_weights(model, config.dummy_seed)
    else:
        _load_checkpoint(model, config, config.weights_path)
    if config.quantization is not None:
        quantize_linears(model, config.quantization)


def _load_checkpoint(model: LlamaForCausalLM, config: ModelConfig, weights_path: str) -> None:
    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"weights_path: no *.safetensors files in {weights_path}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue  # recomputed from the config
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                target, shard = _target(name)
                if target not in params:
                    raise ConfigError(f"weights_path: unexpected tensor {name!r} in {file.name}")
                param = params[target]
                tensor = f.get_tensor(name)
                with torch.no_grad():
                    if shard is None:
                        param.copy_(tensor)
                    else:
                        offsets = _shard_offsets(config, target.split(".")[-2])
                        param[offsets[shard]:offsets[shard + 1]].copy_(tensor)
                loaded.add(target if shard is None else f"{target}#{shard}")
    expected = set()
    for target in params:
        if target == "lm_head.weight" and config.tie_word_embeddings:
            continue
        merged = target.split(".")[-2]
        if merged in ("qkv_proj", "gate_up_proj"):
            expected |= {f"{target}#{i}" for i in range(len(_shard_offsets(config, merged)) - 1)}
        else:
            expected.add(target)
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(f"weights_path: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _target(name: str) -> tuple[str, int | None]:
    for fragment, (merged, shard) in _STACKED.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{merged}."), shard
    return name, None


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of the right shape, the same in every process on the same device type.

    Normal(0, 0.02) like HF's initialiser, so logits are varied enough that greedy decoding does not
    collapse to one token; norms are ones. Generated on the parameter's device: an 8B model is
    filled in well under a second on a GPU instead of minutes on the host.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)

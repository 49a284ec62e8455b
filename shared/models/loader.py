"""Turn a model name (preset, local HF folder, or `dummy:<shape>`) into a `ModelConfig`; load tokenizers.

transformers is imported inside the functions that need it: it takes seconds to import, and
`dummy:` configs and the CLI's thin commands should not pay for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tandem.shared.config import ConfigError, ModelConfig, RopeConfig
from tandem.shared.models.fetch import FETCHABLE_MODELS, fetch_model, is_fetched, model_dir
from tandem.shared.models.presets import DUMMY_PREFIX, DUMMY_SHAPES, dummy_config

SUPPORTED_MODEL_TYPES = ("llama",)
# The fetched model whose tokenizer dummy models borrow.
DUMMY_TOKENIZER_MODEL = "smollm2-135m"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_model_config(name: str, cache_dir: Path | None = None, fetch: bool = True) -> ModelConfig:
    """Resolve `name` to a ModelConfig.

    - a preset (`smollm2-135m`): its folder in the cache, fetched first if missing and `fetch`;
    - a local HF folder of a Llama-family model (`model_type` in SUPPORTED_MODEL_TYPES);
    - `dummy:<shape>` (see presets.DUMMY_SHAPES): random weights; the tokenizer is the cached
      SmolLM2 one when it has been fetched, else None (token-id prompts only). Never fetches.

    Raises ConfigError for anything else, naming what would have been accepted.
    """
    if name.startswith(DUMMY_PREFIX):
        tokenizer_path = None
        if is_fetched(DUMMY_TOKENIZER_MODEL, cache_dir):
            tokenizer_path = str(model_dir(DUMMY_TOKENIZER_MODEL, cache_dir))
        return dummy_config(name[len(DUMMY_PREFIX):], tokenizer_path=tokenizer_path)
    if name in FETCHABLE_MODELS:
        if not fetch and not is_fetched(name, cache_dir):
            raise ConfigError(f"model: {name!r} is not in the cache {model_dir(name, cache_dir)}; "
                              f"run `tandem fetch-model {name}`")
        return config_from_hf_folder(fetch_model(name, cache_dir), name=name)
    path = Path(name).expanduser()
    if path.is_dir():
        return config_from_hf_folder(path)
    raise ConfigError(
        f"model: unknown model {name!r}; expected a preset ({', '.join(sorted(FETCHABLE_MODELS))}), "
        f"a local HF folder, or dummy:<shape> with shape one of {', '.join(DUMMY_SHAPES)}"
    )


def config_from_hf_folder(path: Path, name: str | None = None) -> ModelConfig:
    """Read a local HF folder's config.json (and generation config, tokenizer) into a ModelConfig.

    `name` defaults to the folder's name, not its path: the name enters the KV fingerprint, and two
    workers holding the same model in different places must agree on it.
    """
    from transformers import AutoConfig

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model: folder {str(path)!r} has no config.json")
    # Check the type before AutoConfig, which fails obscurely on types it does not know.
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model: model_type {model_type!r} in {config_file} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    hf = AutoConfig.from_pretrained(str(path))
    tokenizer_path = str(path) if any((path / f).is_file() for f in _TOKENIZER_FILES) else None
    num_heads = hf.num_attention_heads
    return ModelConfig(
        name=name if name is not None else path.resolve().name,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        rope=_rope_config(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        eos_token_ids=_eos_token_ids(path, hf, tokenizer_path),
        bos_token_id=getattr(hf, "bos_token_id", None),
        weights_path=str(path),
        tokenizer_path=tokenizer_path,
    )


def _rope_config(hf: Any) -> RopeConfig:
    # transformers v5 keeps every RoPE setting in `rope_parameters`; v4 has `rope_theta` beside an
    # optional `rope_scaling` dict whose type key was once `type`.
    params = getattr(hf, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"model: rope_type {rope_type!r} is not supported (default, llama3)")
    defaults = RopeConfig()
    theta = float(params.get("rope_theta", defaults.theta))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        defaults.original_max_position_embeddings)),
    )


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _eos_token_ids(path: Path, hf: Any, tokenizer_path: str | None) -> tuple[int, ...]:
    # Chat models often name one EOS in config.json and another in generation_config.json (SmolLM2:
    # <|endoftext|> vs <|im_end|>); generation must stop on any of them.
    eos = _as_ids(getattr(hf, "eos_token_id", None))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos |= _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
    if tokenizer_path is not None:
        eos |= _as_ids(_load_hf_tokenizer(tokenizer_path).eos_token_id)
    return tuple(sorted(eos))


def _load_hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(config: ModelConfig) -> Any:
    """The fast (tokenizers-backed) HF tokenizer of `config`; ConfigError if it has none."""
    if config.tokenizer_path is None:
        raise ConfigError(f"model: {config.name!r} has no tokenizer; for dummy models run "
                          f"`tandem fetch-model {DUMMY_TOKENIZER_MODEL}` once, or pass token ids")
    tokenizer = _load_hf_tokenizer(config.tokenizer_path)
    if not tokenizer.is_fast:
        raise ConfigError(f"model: tokenizer at {config.tokenizer_path} is not a fast tokenizer")
    return tokenizer


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ready for the reply."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("model: the tokenizer has no chat template; send a plain prompt instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers v5 returns a BatchEncoding; v4 a plain list (or a tensor when asked).
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(t) for t in out]

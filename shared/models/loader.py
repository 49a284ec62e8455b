"""Turn a model name (preset, local HF folder, or `dummy:<shape>`) into a `ModelConfig`; load tokenizers.

Nothing here imports transformers (or torch): it takes seconds to import, and the gateway, which
resolves models and tokenizes, must not pay for it. Only `fetch` (converting a preset once) uses it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tandem.common.config import ConfigError, ModelConfig, RopeConfig
from tandem.models.fetch import FETCHABLE_MODELS, fetch_model, is_fetched, model_dir
from tandem.models.presets import DUMMY_PREFIX, DUMMY_SHAPES, dummy_config
from tandem.models.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

SUPPORTED_MODEL_TYPES = ("llama",)
# The fetched model whose tokenizer dummy models borrow.
DUMMY_TOKENIZER_MODEL = "smollm2-135m"
_TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)


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

    config.json is read as plain JSON, a missing key taking transformers' LlamaConfig default, so that the
    result is what `AutoConfig` would give (v4 and v5 spellings of RoPE alike) without importing it.

    `name` defaults to the folder's name, not its path: the name enters the KV fingerprint, and two
    workers holding the same model in different places must agree on it.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model: folder {str(path)!r} has no config.json")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"model: {config_file} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"model: {config_file} is not a JSON object")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model: model_type {model_type!r} in {config_file} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    hf = _LLAMA_DEFAULTS | hf
    tokenizer_path = str(path) if any((path / f).is_file() for f in _TOKENIZER_FILES) else None
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        name=name if name is not None else path.resolve().name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=hf["num_key_value_heads"] or num_heads,
        head_dim=hf["head_dim"] or hf["hidden_size"] // num_heads,
        max_position_embeddings=hf["max_position_embeddings"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope=_rope_config(hf),
        tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        attention_bias=bool(hf["attention_bias"]),
        mlp_bias=bool(hf["mlp_bias"]),
        eos_token_ids=_eos_token_ids(path, hf["eos_token_id"], tokenizer_path),
        bos_token_id=hf["bos_token_id"],
        weights_path=str(path),
        tokenizer_path=tokenizer_path,
    )


# transformers' LlamaConfig defaults for the keys tandem reads (models/llama/configuration_llama.py; the
# same in v4 and v5). num_key_value_heads and head_dim default to the attention heads and
# hidden_size // heads (None stands for that); RoPE defaults are in _rope_config.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# transformers' RotaryEmbeddingConfigMixin.default_theta.
_DEFAULT_ROPE_THETA = 10000.0


def _rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config.json as transformers v5 standardizes them into `rope_parameters`.

    v5 writes one `rope_parameters` dict; v4 a top-level `rope_theta` beside an optional `rope_scaling`
    dict whose type key was once `type`. `rope_scaling` wins over `rope_parameters`, a top-level
    `rope_theta` fills a missing one, and scaled types default their original context to
    max_position_embeddings.
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta")
    params.setdefault("rope_theta", _DEFAULT_ROPE_THETA if theta is None else theta)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return params


def _rope_config(hf: Mapping[str, Any]) -> RopeConfig:
    params = _rope_parameters(hf)
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


def _eos_token_ids(path: Path, config_eos: Any, tokenizer_path: str | None) -> tuple[int, ...]:
    # Chat models often name one EOS in config.json and another in generation_config.json (SmolLM2:
    # <|endoftext|> vs <|im_end|>); generation must stop on any of them.
    eos = _as_ids(config_eos)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos |= _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
    if tokenizer_path is not None and (Path(tokenizer_path) / TOKENIZER_FILE).is_file():
        # Without tokenizer.json there is no tokenizer tandem can load; load_tokenizer says so.
        eos |= _as_ids(_cached_tokenizer(tokenizer_path).eos_token_id)
    return tuple(sorted(eos))


def _cached_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of `path`, read once per process while its files are unchanged.

    load_model_config reads it for its EOS and load_tokenizer right after; parsing tokenizer.json takes
    ~0.1 s. Tokenizer is never modified after loading, so callers may share it.
    """
    stamp = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None
                  for f in (Path(path) / name for name in (*_TOKENIZER_FILES, CHAT_TEMPLATE_FILE)))
    return _load_tokenizer_files(str(Path(path).resolve()), stamp)


@functools.lru_cache(maxsize=8)
def _load_tokenizer_files(path: str, stamp: tuple[Any, ...]) -> Tokenizer:
    return Tokenizer.from_folder(path)


def load_tokenizer(config: ModelConfig) -> Tokenizer:
    """The tokenizer of `config` (tokenizer.json-backed, no transformers); ConfigError if it has none."""
    if config.tokenizer_path is None:
        raise ConfigError(f"model: {config.name!r} has no tokenizer; for dummy models run "
                          f"`tandem fetch-model {DUMMY_TOKENIZER_MODEL}` once, or pass token ids")
    return _cached_tokenizer(config.tokenizer_path)


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

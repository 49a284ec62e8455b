"""Named model shapes for `dummy:<shape>`: real architectures with seeded random weights.

Dummy models exercise the engine at a real model's shapes (memory, kernels, scheduling) with no
download. Their `tokenizer_path` is None here; `load_model_config` fills it with the fetched
SmolLM2 folder when the cache has one, so text prompts work too. SmolLM2's ids are all below
49152, so they are valid inputs for every shape, including the 128256-token Llama-3 ones.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.common.config import ConfigError, ModelConfig, RopeConfig

DUMMY_PREFIX = "dummy:"

_LLAMA3_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
_LLAMA3_BOS = 128000

DUMMY_SHAPES: dict[str, ModelConfig] = {
    # Small enough for unit tests on two CPU cores; SmolLM2's vocabulary so its tokenizer fits.
    "tiny": ModelConfig(
        name="dummy:tiny", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0), tie_word_embeddings=True,
        eos_token_ids=(0, 2), bos_token_id=1,
    ),
    "smollm2-135m": ModelConfig(
        name="dummy:smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0),
        tie_word_embeddings=True, eos_token_ids=(0, 2), bos_token_id=1,
    ),
    "llama-3.2-1b": ModelConfig(
        name="dummy:llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True, eos_token_ids=_LLAMA3_EOS, bos_token_id=_LLAMA3_BOS,
    ),
    "llama-3.1-8b": ModelConfig(
        name="dummy:llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False, eos_token_ids=_LLAMA3_EOS, bos_token_id=_LLAMA3_BOS,
    ),
}


def dummy_config(shape: str, tokenizer_path: str | None = None, seed: int = 0) -> ModelConfig:
    """The config of `dummy:<shape>`: no weights_path (random weights from `seed`).

    Raises ConfigError naming the known shapes when `shape` is not one of them.
    """
    base = DUMMY_SHAPES.get(shape)
    if base is None:
        raise ConfigError(f"model: unknown dummy shape {shape!r}; shapes: {', '.join(DUMMY_SHAPES)}")
    return replace(base, tokenizer_path=tokenizer_path, dummy_seed=seed)

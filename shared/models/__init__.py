"""Model names → configs, weights folders and tokenizers.

`fetch_model` downloads and converts presets once; `load_model_config` resolves any model name
(preset, local HF folder, `dummy:<shape>`); `load_tokenizer` and `apply_chat_template` turn text
and chats into token ids.
"""

from tandem.shared.models.fetch import FETCHABLE_MODELS, FetchError, default_cache_dir, fetch_model
from tandem.shared.models.loader import apply_chat_template, load_model_config, load_tokenizer
from tandem.shared.models.presets import DUMMY_SHAPES, dummy_config

__all__ = [
    "DUMMY_SHAPES",
    "FETCHABLE_MODELS",
    "FetchError",
    "apply_chat_template",
    "default_cache_dir",
    "dummy_config",
    "fetch_model",
    "load_model_config",
    "load_tokenizer",
]

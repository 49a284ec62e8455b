"""Model names → configs, weights folders and tokenizers; loads no torch or transformers at import (only the
one-time GGUF conversion in `fetch` uses them).

`fetch_model` downloads and converts presets once; `load_model_config` resolves any model name
(preset, local HF folder, `dummy:<shape>`); `load_tokenizer` (a `Tokenizer`) and `apply_chat_template`
turn text and chats into token ids. Importing this package loads neither torch nor transformers.
"""

from tandem.models.fetch import FETCHABLE_MODELS, FetchError, default_cache_dir, fetch_model
from tandem.models.loader import apply_chat_template, load_model_config, load_tokenizer
from tandem.models.presets import DUMMY_SHAPES, dummy_config
from tandem.models.tokenizer import Tokenizer

__all__ = [
    "DUMMY_SHAPES",
    "FETCHABLE_MODELS",
    "FetchError",
    "Tokenizer",
    "apply_chat_template",
    "default_cache_dir",
    "dummy_config",
    "fetch_model",
    "load_model_config",
    "load_tokenizer",
]

"""A tokenizer without transformers: the Rust `tokenizers.Tokenizer` plus the HF folder's config.

transformers costs seconds to import and pulls in torch; the gateway needs none of it to turn text into
token ids and back. `Tokenizer` reads what a fast HF tokenizer reads (tokenizer.json, tokenizer_config.json,
chat_template.jinja) and offers the subset of its API that tandem uses, with the same results:

- `encode` / `decode` / `convert_ids_to_tokens` / `convert_tokens_to_ids` / `get_vocab`;
- the special tokens (`eos_token_id`, `all_special_ids`, ...), added to the Rust tokenizer the way
  transformers' TokenizersBackend adds them;
- `apply_chat_template`, rendered with jinja2 in the same sandbox, filters and globals as transformers.

Only tokenizer.json-backed (fast) tokenizers are supported; model-specific tokenizer classes that rebuild
the Rust tokenizer from a vocabulary (instead of loading tokenizer.json) are not reproduced.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken

from tandem.common.config import ConfigError

if TYPE_CHECKING:
    import jinja2

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The named special tokens of transformers' PreTrainedTokenizerBase, in its order.
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Names a message's reasoning may come under; the first is the one chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A fast HF tokenizer's encode/decode/chat-template API over the Rust `tokenizers.Tokenizer`.

    Build it with `Tokenizer.from_folder(path)`. `backend_tokenizer` is the Rust object (what
    `IncrementalDetokenizer` decodes with).
    """

    is_fast = True

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        name_or_path: str = "",
    ) -> None:
        config = dict(config or {})
        self.name_or_path = name_or_path
        self._backend = backend
        # Encoding is per text, never padded or truncated (transformers turns both off for such calls).
        backend.no_truncation()
        backend.no_padding()
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers v5 skips the clean-up for BPE models (it deletes real spaces) unless this is set.
        self._clean_up_bpe = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        backend.encode_special_tokens = self.split_special_tokens
        self.chat_template = chat_template
        self._special_tokens, self._extra_special_tokens = _add_special_tokens(backend, config)
        if backend.post_processor is None:
            # transformers installs a template that adds nothing (tokenizer.json folders never add BOS/EOS
            # from the config's add_bos_token / add_eos_token).
            backend.post_processor = tokenizers.processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Loads the tokenizer of a local HF folder; ConfigError when it has no tokenizer.json."""
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ConfigError(f"model: tokenizer at {folder} is not a fast tokenizer: it has no {TOKENIZER_FILE} "
                              f"(a tokenizer saved by transformers' fast tokenizers is needed)")
        config_file = folder / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ConfigError(f"model: {config_file} is not a JSON object")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust error type is not exported
            raise ConfigError(f"model: cannot read {tokenizer_file}: {e}") from e
        template_file = folder / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _default_template(config.get("chat_template"))
        return cls(backend, config, chat_template=chat_template, name_or_path=str(folder))

    # --- the Rust tokenizer and its vocabulary ------------------------------------------------------

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without the added tokens (as transformers' `vocab_size`)."""
        return int(self._backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._backend.get_added_tokens_decoder())

    # --- special tokens ---------------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (bos_token, eos_token, ..., model-specific `*_token`s) that are set."""
        return dict(self._special_tokens)

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens, then the extra ones, without repeats (transformers' order)."""
        return list(dict.fromkeys([*self._special_tokens.values(), *self._extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._token_id(token) for token in self.all_special_tokens)
        return [i for i in ids if i is not None]  # every special token is in the vocabulary: none is dropped

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_token_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._named_token_id("unk_token")

    def _named_token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._token_id(token)

    def _token_id(self, token: str) -> int | None:
        # An unknown token maps to the unk token's id (None without one), as in transformers.
        index = self._backend.token_to_id(token)
        if index is not None:
            return index
        unk = self._special_tokens.get("unk_token")
        return None if unk is None else self._backend.token_to_id(unk)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """The id of a token (or the ids of a list of tokens); unknown tokens get unk_token_id."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        """The token string of an id (or the strings of a list of ids); None for an id out of range."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # --- text <-> ids -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer.json post-processor (BOS/EOS)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Text of `token_ids`, as transformers' fast tokenizers decode it."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
        clean_up = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        if clean_up and (type(self._backend.model).__name__ != "BPE" or self._clean_up_bpe):
            text = clean_up_tokenization(text)
        return text

    # --- chats ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> Any:
        """Renders `messages` with the chat template: the token ids (`tokenize`) or the text.

        The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the named special
        tokens (`bos_token`, `eos_token`, ...) and `template_kwargs`, exactly as in transformers; the text is
        encoded without adding special tokens (the template writes them).
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = _alias_reasoning_fields([_plain_message(m) for m in messages])
        variables = {**self._special_tokens, **template_kwargs}
        text = _compile(template).render(
            messages=chat,
            tools=_plain_template_data(None if tools is None else list(tools)),
            documents=_plain_template_data(None if documents is None else list(documents)),
            add_generation_prompt=add_generation_prompt,
            **_plain_template_data(variables),
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, added={len(self) - self.vocab_size})"


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: drops the spaces word-level tokenizers put before punctuation."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# --- loading the special tokens -------------------------------------------------------------------


def _as_added_token(value: Any) -> AddedToken | str | None:
    """A token as tokenizer_config.json spells it: a string, or an AddedToken's fields as an object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(**{k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value})
    return None


def _add_special_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Adds the config's tokens to `backend` as transformers' TokenizersBackend does.

    Returns the named special tokens (the standard ones, then model-specific `*_token`s, as strings) and
    the extra special tokens.
    """
    # The tokens whose properties (special, lstrip, ...) win: the config's added_tokens_decoder when it
    # has one, else tokenizer.json's own added tokens.
    config_added: dict[int, AddedToken] = {}
    for index, value in (config.get("added_tokens_decoder") or {}).items():
        token = _as_added_token(value)
        if isinstance(token, AddedToken):
            config_added[int(index)] = token
    known = config_added if "added_tokens_decoder" in config else backend.get_added_tokens_decoder()
    by_content: dict[str, AddedToken] = {token.content: token for token in known.values()}

    named: dict[str, AddedToken | str] = {}
    for key in SPECIAL_TOKEN_ATTRIBUTES:
        token = _as_added_token(config.get(key))
        if token is not None:
            named[key] = by_content.get(str(_content(token)), token)
    # Model-specific tokens (image_token, ...): any other `*_token` string, and a dict of extra tokens.
    model_specific: dict[str, AddedToken | str] = {
        key: value for key, value in config.items()
        if key.endswith("_token") and key not in SPECIAL_TOKEN_ATTRIBUTES and isinstance(value, str)
    }
    extra_value = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    extra: list[AddedToken | str] = []
    if isinstance(extra_value, Mapping):
        for key, value in extra_value.items():
            token = _as_added_token(value)
            if token is not None:
                model_specific[key] = token
    elif isinstance(extra_value, list):
        extra = [t for t in (_as_added_token(v) for v in extra_value) if t is not None]
    named.update(model_specific)

    # Every token of the config's added_tokens_decoder is (re)added, then each named or extra token that
    # the tokenizer does not know yet (as a special token).
    to_add: list[AddedToken | str] = [token for _, token in sorted(config_added.items())]
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    present |= {_content(token) for token in to_add}
    for token in [*named.values(), *extra]:
        if _content(token) not in present:
            to_add.append(token)
            present.add(_content(token))
    named_contents = {_content(token) for token in named.values()}
    tokens = [_special_if_named(token, named_contents) for token in to_add]
    if tokens:
        backend.add_tokens(tokens)
    return {key: _content(token) for key, token in named.items()}, [_content(token) for token in extra]


def _content(token: AddedToken | str) -> str:
    return token if isinstance(token, str) else str(token.content)


def _special_if_named(token: AddedToken | str, named_contents: set[str]) -> AddedToken:
    if isinstance(token, str):
        return AddedToken(token, special=True)
    if not token.special and token.content in named_contents:
        state = {k: getattr(token, k) for k in _ADDED_TOKEN_FIELDS}
        return AddedToken(**(state | {"special": True}))
    return token


def _default_template(value: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    if isinstance(value, Mapping):
        template = value.get("default")
        return template if isinstance(template, str) else None
    return None


# --- rendering chats ----------------------------------------------------------------------------


def _plain_template_data(value: Any) -> Any:
    """A copy of `value` made of plain JSON types only, so the sandboxed template sees no methods of rich
    objects (anything else becomes a placeholder naming its type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return _plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the OpenAI SDK's messages)
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _plain_message(message: Any) -> dict[str, Any]:
    # Keys whose value is None are dropped: templates handle a missing key, not `content: None`.
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    elif not isinstance(message, Mapping) and callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages should be dicts, dataclasses or pydantic models, got {message!r}")
    plain = _plain_template_data({k: v for k, v in message.items() if v is not None})
    assert isinstance(plain, dict)
    return plain


def _alias_reasoning_fields(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # A message's reasoning under an older name is also given as `reasoning_content` (what templates read)
    # and `thinking` (what gpt-oss templates read).
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The template compiled in transformers' sandbox: same options, filters and globals."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller: Callable[[], str]) -> str:
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore attributes (a way out of the sandbox)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's trick: `namespace(self=...)` works
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_namespace_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_namespace_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class SafeDict:
        """`dict(...)` / `dict.fromkeys(...)` without the dict type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict[Any, Any]:
            return dict.fromkeys(keys, value)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = SafeDict()
    env.globals["namespace"] = SafeNamespace
    return env.from_string(template)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        import jinja2.exceptions

        raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r}) "
                                              "on a namespace")

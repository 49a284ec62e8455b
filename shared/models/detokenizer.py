"""Streaming detokenization with stop strings: token ids in, settled text out.

The gateway owns text (docs/architecture.md): it turns each request's token stream into text as the
tokens arrive, and matches stop strings on that text, so that a stop is seen on the very token that
completes it and decode can be cancelled at once.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandem.models.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output: enough for the tokenizer to render the first output token
# as it would mid-text (a SentencePiece decoder drops the leading space of a text's first token).
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, incrementally, and watches for stop strings.

    `push(token_ids)` returns the text that became settled: text is held back while it ends in an
    incomplete UTF-8 sequence (byte-level tokens split a multi-byte character) or while it could be the
    start of a stop string. On a stop string the text is cut exactly before it, `stopped` turns True and
    later tokens are ignored. `finish()` returns what was held back when generation ends. Without a stop,
    the concatenation of everything returned equals `tokenizer.decode(output_ids)` (without clean-up).

    Two ways to get there, with the same results:
    - a byte-level BPE tokenizer (GPT-2's alphabet: SmolLM2, Llama 3, Qwen) maps every token to fixed bytes,
      so the text is those bytes through an incremental UTF-8 decoder, which holds back an incomplete
      character by itself (`byte_level_table`; ~1 µs a token against two tokenizer calls of ~3-25 µs);
    - any other tokenizer takes vLLM's window: a window of tokens from `prefix_offset` is decoded, and the
      text past that of the tokens before `read_offset` is new; both offsets move up once the window ends on
      a complete character, so each step decodes only a few tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        # The Rust `tokenizers.Tokenizer` behind a fast tokenizer (None for a slow one).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._token_bytes = None if self._backend is None else byte_level_table(self._backend, skip_special_tokens)
        if self._token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            # Only the tokens from prefix_offset on are kept; the offsets index into this window.
            self._window_ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
            self._read_offset = len(self._window_ids)
            self._prefix_text = self._decode(self._window_ids)
            # Characters of the window's text past _prefix_text already settled.
            self._num_window_chars = 0
        # Settled text not yet given to the caller: held back as a possible stop-string start (and, once
        # stopped, cut before the stop string). Text already returned cannot start a stop string.
        self._pending = ""
        self._is_finished = False
        self.stopped = False
        # Output tokens that count: all pushed so far, or up to and including the one that completed
        # the stop string.
        self.num_tokens_used = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Feeds new output tokens; returns the text that became settled (possibly "")."""
        assert not self._is_finished, "push() after finish()"
        if self.stopped:
            return ""
        if not self._stop:
            # No stop string to attribute to a token: the new tokens are decoded together.
            self.num_tokens_used += len(token_ids)
            self._pending += self._settle(token_ids, is_final=False)
            return self._release(hold_back=True)
        for token_id in token_ids:
            # One token at a time, so that a stop is attributed to the token that completed it.
            self.num_tokens_used += 1
            self._pending += self._settle((token_id,), is_final=False)
            if self._cut_at_stop():
                break
        return self._release(hold_back=not self.stopped)

    def finish(self) -> str:
        """Ends the stream: returns everything held back, even an incomplete character (as U+FFFD)."""
        assert not self._is_finished, "finish() called twice"
        self._is_finished = True
        if self.stopped:
            return ""
        self._pending += self._settle((), is_final=True)
        self._cut_at_stop()
        return self._release(hold_back=False)

    def _settle(self, token_ids: Sequence[int], is_final: bool) -> str:
        """The text that the new tokens settle (with `is_final`: also what was held back)."""
        table = self._token_bytes
        if table is not None:
            try:
                data = b"".join([table[token_id] for token_id in token_ids])
            except IndexError:  # ids past the tokenizer's vocabulary (a padded embedding) decode to nothing
                data = b"".join([table[token_id] if 0 <= token_id < len(table) else b"" for token_id in token_ids])
            return self._utf8.decode(data, final=is_final)
        self._window_ids.extend(token_ids)
        return self._settle_window(is_final)

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across token boundaries (" ." -> "."), so
        # slices decoded apart would not add up to the whole.
        if self._backend is not None:
            # What transformers' decode does for a fast tokenizer without clean-up, minus its Python layers
            # (~25 µs a call, twice per token).
            return str(self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens))
        text = self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # a flat list of ids decodes to one string
        return text

    def _settle_window(self, is_final: bool) -> str:
        window_text = self._decode(self._window_ids)
        is_complete = not window_text.endswith(_REPLACEMENT_CHAR)
        # Trailing U+FFFD stand for an incomplete UTF-8 sequence that later tokens may complete. The text
        # before them is final already (UTF-8 resynchronizes after a complete character), so it is
        # released now, not a token later, and a stop string in it is seen on the token completing it.
        settled = window_text if is_final or is_complete else window_text.rstrip(_REPLACEMENT_CHAR)
        new_text = settled[len(self._prefix_text):]
        settled_now = new_text[self._num_window_chars:]
        self._num_window_chars = max(self._num_window_chars, len(new_text))
        if is_complete and len(window_text) > len(self._prefix_text):
            # The window ends on a complete character: move both offsets up and forget older tokens.
            del self._window_ids[: self._read_offset]
            self._read_offset = len(self._window_ids)
            self._prefix_text = self._decode(self._window_ids)
            self._num_window_chars = 0
        return settled_now

    def _cut_at_stop(self) -> bool:
        """Cuts the pending text before the earliest stop string in it; returns whether one was found."""
        found = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if not found:
            return False
        self._pending = self._pending[: min(found)]
        self.stopped = True
        return True

    def _release(self, hold_back: bool) -> str:
        end = len(self._pending) - (self._num_chars_maybe_stop(self._pending) if hold_back else 0)
        released = self._pending[:end]
        self._pending = self._pending[end:]
        return released

    def _num_chars_maybe_stop(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def warm_detokenizer(tokenizer: Tokenizer | PreTrainedTokenizerBase) -> None:
    """Builds what `IncrementalDetokenizer` decodes with for this tokenizer now, not on its first use."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        byte_level_table(backend, skip_special_tokens=True)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a token's string."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    alphabet = {chr(byte): byte for byte in printable}
    others = (byte for byte in range(256) if byte not in alphabet.values())
    alphabet.update((chr(256 + i), byte) for i, byte in enumerate(others))
    return alphabet


def byte_level_table(backend: Any, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    """Each token id's bytes when `backend` (a `tokenizers.Tokenizer`) decodes byte-level, else None.

    Built from the token strings the way the ByteLevel decoder reads them (each character through GPT-2's
    alphabet; a token with a character outside it, such as an added token, as its own UTF-8), then checked
    against the tokenizer itself: every token decoded alone must give the table's bytes decoded, or the
    tokenizer is not taken to be byte-level. Built once per tokenizer (~0.25 s for 50k tokens): the gateway
    builds it at start-up.
    """
    tables = _byte_level_tables(backend)
    return None if tables is None else tables[skip_special_tokens]


@functools.lru_cache(maxsize=8)
def _byte_level_tables(backend: Any) -> dict[bool, tuple[bytes, ...]] | None:
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":  # tokenizers.decoders.ByteLevel
        return None
    alphabet = _byte_level_alphabet()
    # A token's characters to the latin-1 characters of its bytes, so that encoding it gives the bytes.
    to_latin1 = str.maketrans({char: chr(byte) for char, byte in alphabet.items()})
    characters = set(alphabet)
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None:
            table.append(b"")
        elif characters.issuperset(token):
            table.append(token.translate(to_latin1).encode("latin-1"))
        else:
            table.append(token.encode())
    special = {token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special}
    tables = {False: tuple(table), True: tuple(b"" if i in special else data for i, data in enumerate(table))}
    for skip, candidate in tables.items():
        decoded = backend.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=skip)
        if any(text != data.decode(errors="replace") for text, data in zip(decoded, candidate, strict=True)):
            return None
    return tables

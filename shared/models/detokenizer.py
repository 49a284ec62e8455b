"""Streaming detokenization with stop strings: token ids in, settled text out.

The gateway owns text (docs/architecture.md): it turns each request's token stream into text as the
tokens arrive, and matches stop strings on that text, so that a stop is seen on the very token that
completes it and decode can be cancelled at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

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

    The decoding is vLLM's: a window of tokens from `prefix_offset` is decoded, and the text past that of
    the tokens before `read_offset` is new; both offsets move up once the window ends on a complete
    character, so each step decodes only a few tokens.
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
        # Only the tokens from prefix_offset on are kept; the offsets index into this window.
        self._window_ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        # Characters of the window's text past _prefix_text already appended to _text.
        self._num_window_chars = 0
        # All settled output text (cut before the stop string once stopped); the caller has been given
        # _text[:_num_emitted_chars], the rest is held back as a possible stop-string start.
        self._text = ""
        self._num_emitted_chars = 0
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
            self._window_ids.extend(token_ids)
            self._append_settled_text(is_final=False)
            return self._release(hold_back=True)
        for token_id in token_ids:
            # One token at a time, so that a stop is attributed to the token that completed it.
            self.num_tokens_used += 1
            self._window_ids.append(token_id)
            self._append_settled_text(is_final=False)
            if self._cut_at_stop():
                break
        return self._release(hold_back=not self.stopped)

    def finish(self) -> str:
        """Ends the stream: returns everything held back, even an incomplete character (as U+FFFD)."""
        assert not self._is_finished, "finish() called twice"
        self._is_finished = True
        if self.stopped:
            return ""
        self._append_settled_text(is_final=True)
        self._cut_at_stop()
        return self._release(hold_back=False)

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across token boundaries (" ." -> "."), so
        # slices decoded apart would not add up to the whole.
        if self._backend is not None:
            # What transformers' decode does for a fast tokenizer without clean-up, minus its Python layers
            # (~25 µs a call, twice per token: most of the gateway's detokenization time).
            return str(self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens))
        text = self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # a flat list of ids decodes to one string
        return text

    def _append_settled_text(self, is_final: bool) -> None:
        window_text = self._decode(self._window_ids)
        is_complete = not window_text.endswith(_REPLACEMENT_CHAR)
        # Trailing U+FFFD stand for an incomplete UTF-8 sequence that later tokens may complete. The text
        # before them is final already (UTF-8 resynchronizes after a complete character), so it is
        # released now, not a token later, and a stop string in it is seen on the token completing it.
        settled = window_text if is_final or is_complete else window_text.rstrip(_REPLACEMENT_CHAR)
        new_text = settled[len(self._prefix_text):]
        self._text += new_text[self._num_window_chars:]
        self._num_window_chars = max(self._num_window_chars, len(new_text))
        if is_complete and len(window_text) > len(self._prefix_text):
            # The window ends on a complete character: move both offsets up and forget older tokens.
            del self._window_ids[: self._read_offset]
            self._read_offset = len(self._window_ids)
            self._prefix_text = self._decode(self._window_ids)
            self._num_window_chars = 0

    def _cut_at_stop(self) -> bool:
        """Cuts _text before the earliest stop string in it; returns whether one was found."""
        # Text already emitted cannot start a match: it was released only once no stop could start in it.
        found = [i for i in (self._text.find(s, self._num_emitted_chars) for s in self._stop) if i >= 0]
        if not found:
            return False
        self._text = self._text[: min(found)]
        self.stopped = True
        return True

    def _release(self, hold_back: bool) -> str:
        end = len(self._text)
        if hold_back:
            end -= self._num_chars_maybe_stop(self._text[self._num_emitted_chars:])
        released = self._text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
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

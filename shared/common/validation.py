"""The checks every door applies to a prompt, in one place: the gateway runs them before routing, and the
engine again before it allocates anything (a worker may be called directly)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.common.errors import InvalidRequestError


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int,
                    max_tokens: int | None = None) -> None:
    """Raise InvalidRequestError, naming the field, for a prompt no worker can serve: empty, a token id
    outside [0, vocab_size), no room for one output token, or (with `max_tokens`) prompt plus output past
    the context length."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if num_prompt >= max_model_len:
        raise InvalidRequestError("prompt", f"is {num_prompt} tokens; the context length is {max_model_len} "
                                            "(prompt plus at least one output token must fit)")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError("max_tokens", f"{max_tokens} plus the {num_prompt}-token prompt exceeds the "
                                                f"context length {max_model_len}")

"""The checks every door applies to a prompt and its sampling values, in one place: the gateway runs them before
routing, and the engine again before it allocates anything (a worker may be called directly)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.common.errors import InvalidRequestError
from tandem.common.sampling_params import SamplingParams


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int,
                    max_tokens: int | None = None) -> None:
    """Raise InvalidRequestError, naming the field, for a prompt no worker can serve: empty, a token id
    outside [0, vocab_size), no room for one output token, or (with `max_tokens`) prompt plus output past
    the context length."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    # The length first: a prompt of millions of ids is refused without a pass over them.
    if num_prompt >= max_model_len:
        raise InvalidRequestError("prompt", f"is {num_prompt} tokens; the context length is {max_model_len} "
                                            "(prompt plus at least one output token must fit)")
    # min / max run in C (a generator over every id cost the gateway ~30 us per 256-token prompt); only a prompt
    # that fails is searched for its first bad id.
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError("max_tokens", f"{max_tokens} plus the {num_prompt}-token prompt exceeds the "
                                                f"context length {max_model_len}")


# Widths of the worker protocol's sampling fields (tandem.v1.WorkerSamplingParams): a larger value cannot be
# sent, and must be refused rather than fail the conversion (or wrap).
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def validate_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError, naming the field, for sampling values no worker can be sent intact: a
    boolean where a count belongs, a value past its field's width on the wire (max_tokens uint32, top_k int32,
    temperature float32), or a stop token id outside [0, vocab_size). `SamplingParams` has checked the rest."""
    for name in ("max_tokens", "top_k", "seed"):
        if isinstance(getattr(params, name), bool):
            raise InvalidRequestError(name, "must be an integer, not a boolean")
    if params.max_tokens > _UINT32_MAX:
        raise InvalidRequestError("max_tokens", f"must be at most {_UINT32_MAX}, got {params.max_tokens}")
    if params.top_k > _INT32_MAX:
        raise InvalidRequestError("top_k", f"must be at most {_INT32_MAX}, got {params.top_k}")
    if params.temperature > _FLOAT32_MAX:
        raise InvalidRequestError("temperature", f"must be at most {_FLOAT32_MAX:.4g}, got {params.temperature!r}")
    bad = next((t for t in params.stop_token_ids if isinstance(t, bool) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("stop_token_ids", f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")

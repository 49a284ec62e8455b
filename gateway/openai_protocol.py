"""OpenAI's request and response bodies, and their conversion to and from tandem's types.

No I/O here: `http_api.py` serves these. Requests are strict: a field we do not know, or a known one
with a value we cannot honour, is an error naming that field (OpenAI's body shape, status 400); a
known field whose value changes nothing (`n: 1`, `presence_penalty: 0`, `user`) is accepted, because
client libraries send such values routinely. Types are strict too (pydantic's strict mode, as OpenAI's own
API): `true` is no integer, `5.0` no count, `"1"` no number (an integer is a number); and text must be valid
Unicode (JSON's `\ud800` escapes can spell a lone surrogate, which no tokenizer or UTF-8 encoder takes).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.common.errors import InvalidRequestError
from tandem.common.sampling_params import SamplingParams
from tandem.gateway.limits import GatewayLimits

# The legacy completions endpoint's documented default; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_SEED_MODULUS = 2**64
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Every string of a request, or of a list of them, must be valid Unicode (the regex runs in C: a few
        µs for a long prompt). Lists are homogeneous by now, so a list of ids is not walked."""
        texts = [value] if isinstance(value, str) else value if isinstance(value, list) and value and isinstance(
            value[0], str) else ()
        for i, text in enumerate(texts):
            if (match := _SURROGATE.search(text)) is not None:
                where = f"item {i}, " if texts is value else ""
                raise ValueError(f"is not valid Unicode: a lone surrogate (U+{ord(match.group()):04X}) at {where}"
                                 f"character {match.start()}")
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # `limits.CHAT_ROLES`, the roles both doors accept (a Literal, so that the schema lists them).
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFormat(_Strict):
    type: Literal["text"]


class _GenerationRequest(_Strict):
    """Fields both endpoints share. None means "not given": `SamplingParams` holds the defaults."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # The range the worker protocol carries (uint64): a larger or negative seed is refused, never wrapped.
    seed: int | None = Field(None, ge=0, lt=_SEED_MODULUS)
    stop: str | list[str] | None = None
    # Bounded by prompts × n against the gateway's --max-sequences-per-request (`check_limits`).
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted only at values that change nothing (checked in `check_supported`).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Ignored: it only identifies the caller to OpenAI.
    user: str | None = None
    # Extensions, with vLLM's names.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(name, "is not supported; only 0 is accepted")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias", "is not supported; only an empty map is accepted")

    def check_limits(self, limits: GatewayLimits, num_prompts: int) -> None:
        """The gateway's bounds on what this request asks for, checked before its prompts are tokenized."""
        limits.check_sequences(num_prompts, self.n)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        limits.check_stop(stop, self.stop_token_ids or [])

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, choice: int) -> SamplingParams:
        """The engine's params for sample `choice` (0..n-1) of one prompt; bad values raise
        InvalidRequestError naming the field."""
        given: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
        }
        # n seeded samples of one prompt must differ, yet each stays reproducible (sample j of seed s draws with
        # s + j, which only wraps past 2**64 - 1 for the samples of a seed that close to the top).
        seed = None if self.seed is None else (self.seed + choice) % _SEED_MODULUS
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, seed=seed,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            **{k: v for k, v in given.items() if v is not None})


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; the newer one wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs", "is not supported: the engine reports only the chosen "
                                                      "token's logprob; use logprobs: true with top_logprobs 0")


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # The legacy API's logprobs is a count of alternatives; only the chosen token's is available.
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts: a string, a list of ids, or a batch of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise InvalidRequestError("logprobs", "only 0 is supported: the engine reports only the chosen "
                                                  "token's logprob")
        if self.echo:
            raise InvalidRequestError("echo", "is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of", "only 1 is supported")
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported")


# Responses ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    id: str
    object: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, object: str, model: str) -> ResponseHeader:
        return cls(f"{prefix}-{uuid.uuid4().hex}", object, model, int(time.time()))

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens found in the decode worker's
    prefix cache."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """Chat's `logprobs` object: each token's text and logprob, with no alternatives."""
    content = []
    for token_id, logprob in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
                        "top_logprobs": []})
    return {"content": content}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}

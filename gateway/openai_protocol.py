"""OpenAI's request and response bodies, and their conversion to and from tandem's types.

No I/O here: `http_api.py` serves these. Requests are strict: a field we do not know, or a known one
with a value we cannot honour, is an error naming that field (OpenAI's body shape, status 400); a
known field whose value changes nothing (`n: 1`, `presence_penalty: 0`, `user`) is accepted, because
client libraries send such values routinely.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.common.errors import InvalidRequestError
from tandem.common.sampling_params import SamplingParams

# The legacy completions endpoint's documented default; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_SEED_MODULUS = 2**64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; tool messages need tool calling, which we lack.
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
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
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

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, choice: int) -> SamplingParams:
        """The engine's params for sample `choice` (0..n-1) of one prompt; bad values raise
        InvalidRequestError naming the field."""
        given: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
        }
        # n seeded samples of one prompt must differ, yet each stays reproducible.
        seed = self.seed if self.seed is None or self.seed < 0 else (self.seed + choice) % _SEED_MODULUS
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


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


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

"""What one request may ask of the gateway, checked before the work it would cost (reading a body whole,
tokenizing, routing). Every bound is a `tandem gateway` flag; docs/security.md lists them with their defaults.

A request past a bound is refused with InvalidRequestError naming the field (HTTP 400, gRPC INVALID_ARGUMENT),
except a body or message past `max_request_bytes` (HTTP 413, gRPC RESOURCE_EXHAUSTED) and a request whose
sequences do not fit the free concurrency slots (HTTP 429, gRPC RESOURCE_EXHAUSTED; see `admission.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.common.config import ConfigError
from tandem.common.errors import InvalidRequestError
from tandem.serving.service import SESSION_HEARTBEAT_S

MiB = 1024 * 1024
# A token is a few characters of text; 32 per token of context leaves room for any real prompt (even one
# of single-character tokens) while refusing, before tokenizing, a text that cannot fit the context.
PROMPT_CHARS_PER_TOKEN = 32
# The roles a chat message may have, on both doors. "developer" is OpenAI's newer name for "system"; a
# tool message needs tool calling, which tandem does not have.
CHAT_ROLES = ("system", "developer", "user", "assistant")
# A decode worker is declared frozen only after this many heartbeats in a row failed to arrive.
MIN_STALLED_HEARTBEATS = 4
# The most tokens per client message a saturated gateway process goes to (`--max-stream-interval`, `StreamPacer`).
# On an H100 host one gateway process over 256 streams at 1 ms steps used 33.4 µs of CPU per token with the pacer
# off and 17.1 with 16 (benchmarks/results, "One H100, 2026-12-07, second session"); an unsaturated process stays at 1.
DEFAULT_MAX_STREAM_INTERVAL = 16


@dataclass(frozen=True)
class GatewayLimits:
    """The gateway's bounds on one request (the concurrency limit, shared by all, is the `Router`'s), and how
    its stream is cut into messages."""

    # An HTTP body (413 past it, refused before it is read whole) or a gRPC message (RESOURCE_EXHAUSTED).
    max_request_bytes: int = 16 * MiB
    # Characters of one prompt, or of a chat's contents together; None: 32 × the context length.
    max_prompt_chars: int | None = None
    # Messages of one chat (OpenAI's own bound).
    max_messages: int = 2048
    # Stop strings of one request, and characters of each (TGI's default is 4 strings).
    max_stop_sequences: int = 16
    max_stop_chars: int = 256
    # Stop token ids of one request.
    max_stop_token_ids: int = 1024
    # Sequences one request generates (prompts × n), each its own decode request.
    max_sequences_per_request: int = 128
    # Seconds a decode worker may stay silent, with requests of this gateway in flight, before it is taken
    # for frozen and its requests resume elsewhere (decode workers send a heartbeat every SESSION_HEARTBEAT_S).
    decode_stall_timeout_s: float = 10.0
    # Tokens per streamed message after the first (vLLM's and SGLang's --stream-interval): 1 sends each step's
    # tokens as they come; N > 1 cuts the gateway's CPU per token (a message costs far more than a token)
    # for a burstier stream. The first tokens and the last are never held back.
    stream_interval: int = 1
    # The most tokens per streamed message the gateway goes to while its event loop is saturated (`StreamPacer`):
    # above `stream_interval`, a gateway process that falls behind sends fewer, larger messages and comes back
    # to `stream_interval` once it keeps up. 1: off.
    max_stream_interval: int = DEFAULT_MAX_STREAM_INTERVAL
    # Prompts with at most this many tokens not in the decode worker's prefix cache are prefilled by the decode
    # worker itself even when a prefill worker is up (conditional disaggregation, as NVIDIA Dynamo's
    # --max-local-prefill-length): a short prompt's chunk costs a decode step little, and it skips the prefill
    # worker's queue and the page handoff. 0: every prompt goes to a prefill worker when there is one.
    local_prefill_max_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_messages", "max_stop_sequences", "max_stop_chars",
                     "max_stop_token_ids", "max_sequences_per_request", "stream_interval",
                     "max_stream_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.local_prefill_max_tokens < 0:
            raise ConfigError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ConfigError(f"max_prompt_chars must be at least 1, got {self.max_prompt_chars}")
        min_stall_s = MIN_STALLED_HEARTBEATS * SESSION_HEARTBEAT_S
        if not self.decode_stall_timeout_s >= min_stall_s:
            raise ConfigError(f"decode_stall_timeout_s must be at least {min_stall_s} s ({MIN_STALLED_HEARTBEATS} "
                              f"decode heartbeats), got {self.decode_stall_timeout_s}")

    def prompt_chars(self, max_model_len: int) -> int:
        """The most characters a prompt may have against a context of `max_model_len` tokens."""
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len

    def check_prompt(self, text: str, max_model_len: int) -> None:
        limit = self.prompt_chars(max_model_len)
        if len(text) > limit:
            raise InvalidRequestError("prompt", f"is {len(text)} characters; at most {limit} are accepted "
                                                f"(context length {max_model_len} tokens)")

    def check_messages(self, messages: Sequence[Mapping[str, str]], max_model_len: int) -> list[dict[str, str]]:
        """The chat as the template takes it ("developer" becomes "system"), once its size and roles pass."""
        if len(messages) > self.max_messages:
            raise InvalidRequestError("messages", f"{len(messages)} messages; at most {self.max_messages} "
                                                  "are accepted")
        chat = []
        num_chars = 0
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role not in CHAT_ROLES:
                raise InvalidRequestError("messages", f"message {i}: role {role!r} is not one of "
                                                      f"{', '.join(CHAT_ROLES)}")
            num_chars += len(content)
            chat.append({"role": "system" if role == "developer" else role, "content": content})
        limit = self.prompt_chars(max_model_len)
        if num_chars > limit:
            raise InvalidRequestError("messages", f"the contents are {num_chars} characters; at most {limit} are "
                                                  f"accepted (context length {max_model_len} tokens)")
        return chat

    def check_stop(self, stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
        if len(stop) > self.max_stop_sequences:
            raise InvalidRequestError("stop", f"{len(stop)} stop strings; at most {self.max_stop_sequences} "
                                              "are accepted")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise InvalidRequestError("stop", f"a stop string of {longest} characters; at most "
                                              f"{self.max_stop_chars} are accepted")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequestError("stop_token_ids", f"{len(stop_token_ids)} ids; at most "
                                                        f"{self.max_stop_token_ids} are accepted")

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """One request's prompts × n against the per-request bound (each sequence is a decode request)."""
        num_sequences = num_prompts * n
        if num_sequences > self.max_sequences_per_request:
            field = "n" if n > 1 else "prompt"
            raise InvalidRequestError(field, f"{num_prompts} prompt(s) × n={n} is {num_sequences} sequences; at "
                                             f"most {self.max_sequences_per_request} per request are accepted")

"""Prompts → token ids at the gateway, large ones off the event loop.

Encoding a prompt of a few hundred thousand characters takes the Rust tokenizer a tenth of a second or more;
on the event loop that would stall every other client's stream (and `/health`) as long. Prompts past
`OFFLOAD_CHARS` are encoded on a small thread pool instead, through `encode_batch`, which releases the GIL while
it runs (`encode` holds it, so a thread alone would not help). Small prompts stay inline: a hop to a thread
costs more than encoding them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tandem.common.errors import InvalidRequestError
from tandem.models import apply_chat_template

# About 2 ms of encoding inline at most (measured with SmolLM2's tokenizer on the 2-core CPU host).
OFFLOAD_CHARS = 4096
_T = TypeVar("_T")


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, releasing the GIL for a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The chat rendered by the tokenizer's template, ready for the reply, as token ids."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("messages", "this model's tokenizer has no chat template; send a prompt instead")
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return apply_chat_template(tokenizer, [dict(m) for m in messages])
    # The template writes the special tokens itself, so the text is encoded without adding any.
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return encode_text(tokenizer, text)


class PromptEncoder:
    """Encodes prompts and chats for the router; owns the thread pool the large ones go to."""

    def __init__(self, tokenizer: Any, max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tandem-tokenize")

    async def text(self, text: str) -> list[int]:
        return await self._run(len(text), encode_text, text)

    async def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        num_chars = sum(len(m["content"]) for m in messages)
        return await self._run(num_chars, encode_chat, messages)

    async def _run(self, num_chars: int, encode: Callable[[Any, _T], list[int]], value: _T) -> list[int]:
        if num_chars <= OFFLOAD_CHARS:
            return encode(self.tokenizer, value)
        return await asyncio.get_running_loop().run_in_executor(self._executor, encode, self.tokenizer, value)

    async def offload(self, fn: Callable[[_T], None], value: _T) -> None:
        """`fn(value)` on the same thread pool (other work that is too long for the event loop: hashing a long
        prompt's blocks)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, fn, value)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

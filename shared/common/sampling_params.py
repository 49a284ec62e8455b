"""Per-request sampling parameters, validated before anything is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.common.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token, and when to stop (vLLM's names and defaults)."""

    max_tokens: int = 16
    # 0 means greedy (argmax).
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    # A request with a seed draws from a generator keyed by (seed, output position): the same
    # tokens whatever batch it shares and whichever process samples each token.
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # As in vLLM: EOS may be emitted and generation runs on to max_tokens.
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the params are hashable, frozen).
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidRequestError("seed", f"must be in [0, 2**64), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")

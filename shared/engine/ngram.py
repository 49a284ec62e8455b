"""N-gram (prompt lookup) proposals for speculative decoding: no draft model, only the request's own tokens.

If the last n tokens of a sequence occurred before, the text likely continues as it did then (a model
repeating its prompt, editing code, quoting a document, or looping). For n from `max_n` down to `min_n`, the
proposer finds the most recent earlier occurrence of the sequence's last n tokens and proposes the K tokens
that followed it. Host-side numpy: the tokens live on the host (the scheduler applies them), and the result
feeds the step's input ids, which the runner builds on the host anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tandem.engine.spec_decode import SpeculativeConfig


class NgramProposer:
    """Proposes up to `num_speculative_tokens` tokens per sequence by prompt lookup.

    A sequence t[0:L] has a match of length n ending at e (e <= L - 2, so the occurrence is an earlier one;
    it may overlap the suffix) when t[e-n+1 : e+1] == t[L-n : L]. The longest n in [min_n, max_n] wins, and
    among the ends with that n, the most recent (largest e): recent text predicts the next tokens best, and a
    loop's latest period is the one it repeats. (vLLM takes the earliest; tandem prefers locality.)

    The proposal is what followed the occurrence: t[e+1], t[e+2], ... Near the end these run into the
    suffix and then past L; like an LZ77 copy whose source overlaps its destination, the copy goes on
    through the tokens it has just proposed, so t[e+1+j] for j >= L-e-1 is proposal[j - (L-1-e)]. A match
    therefore always yields K tokens, and a loop of period d = L-1-e is extended as a loop
    (proposal[j] = t[e + 1 + j % d]) rather than cut off where the text ends.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        assert num_speculative_tokens >= 1 and 1 <= min_n <= max_n, (num_speculative_tokens, min_n, max_n)
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        assert config.method == "ngram", config.method
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None  # resolved by it
        return cls(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, token_ids: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """Each sequence's proposal (prompt + output so far → K token ids, or [] without a match)."""
        if not token_ids:
            return []
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        # Padding -1 is no token id, and the masks below never read it as one.
        tokens = np.full((len(token_ids), max(int(lengths.max()), 1)), -1, dtype=np.int32)
        for row, ids in zip(tokens, token_ids, strict=True):
            row[:len(ids)] = ids
        return self.propose_padded(tokens, lengths)

    def propose_padded(self, tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
        """tokens [B, L] of ids >= 0 (row b valid up to lengths[b]; what follows is ignored), lengths [B] →
        proposals.

        Vectorised over the batch and the positions: O(B * L * max_n) elementwise work in max_n numpy passes
        and no Python loop over tokens. On the 2-core CPU box, max_n 4: 1.7 ms for 256 x 2048 tokens, 0.3 ms
        for 32 x 2048. Building this array from Python lists (`propose`) costs more, ~10 ms for 256 x 2048, so
        a serving loop should keep each request's ids in a host array and append only the new ones. (An
        n-gram index per request, updated with each new token, would make the lookup O(max_n) per token.)
        """
        num_seqs, width = tokens.shape
        rows = np.arange(num_seqs)
        # runs[k][b, e]: the k + 1 tokens ending at e equal the sequence's last k + 1 tokens, built one token
        # further back per pass. Only ends e <= L - 2 count: the occurrence must be an earlier one.
        run = np.arange(width)[None, :] <= lengths[:, None] - 2  # [B, W]
        runs = []
        for k in range(min(self.max_n, width)):  # no match reaches further back than the row
            suffix_pos = lengths - 1 - k  # [B]
            # -1 is no token id, so a suffix shorter than k + 1 matches nothing (run is False past L - 2, so
            # the padding is never compared where it could count).
            suffix_tok = np.where(suffix_pos >= 0, tokens[rows, np.maximum(suffix_pos, 0)], -1)
            run = run.copy()
            run[:, :k] = False  # t[e - k] would be before the start
            run[:, k:] &= tokens[:, :width - k] == suffix_tok[:, None]
            runs.append(run)
        # Runs shrink as k grows: the longest match is the number of passes that left the row a True.
        best_n = np.stack([r.any(axis=1) for r in runs]).sum(axis=0) if runs else np.zeros(num_seqs, np.int64)
        has_match = best_n >= self.min_n
        if not has_match.any():
            return [[] for _ in range(num_seqs)]
        # The most recent end among those with the longest match: the last True of each row.
        is_best = np.stack(runs)[np.maximum(best_n - 1, 0), rows]  # [B, W]
        last_end = width - 1 - np.argmax(is_best[:, ::-1], axis=1)  # [B]
        period = lengths - 1 - last_end  # d >= 1 where has_match
        offsets = np.arange(self.num_speculative_tokens)[None, :] % np.maximum(period, 1)[:, None]  # [B, K]
        proposals = tokens[rows[:, None], np.minimum(last_end[:, None] + 1 + offsets, width - 1)]
        return [proposals[b].tolist() if has_match[b] else [] for b in range(num_seqs)]

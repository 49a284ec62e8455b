"""Speculative decoding, the parts that do not depend on the step layout: the config, verification of
proposals against the target model's logits, and the stop rules applied to a verified run.

A verify step feeds each speculating request its last accepted token plus its k proposals (k <= K) and
computes logits at those k + 1 positions: row j predicts output position `num_output_tokens + j`.

`verify` keeps the output token-for-token identical to decoding one token at a time, greedy and seeded
alike (every tandem request has a resolved seed). At row j it computes the token the target itself would
emit at that output position, with the sampler's own draw (`sampler.sample`: argmax, or the exponential
race on the noise keyed by (seed, position, vocabulary index) after temperature, top-k and top-p), and
accepts proposal j iff it equals that token; the first row that rejects (or row k, once all are accepted)
emits the target's own token. Why this is exact, by induction on j: if proposals 0..j-1 were accepted they
equal the target's tokens, so row j's logits are the target's logits after exactly the prefix one-at-a-time
decoding would have; the sampler's draw depends only on those logits, the seed and the output position, so
row j's token is the one one-at-a-time decoding emits there. The emitted run is the target's tokens at rows
0..num_accepted, i.e. the next num_accepted + 1 tokens of the non-speculative output. (Exactly equal logits
are the premise: a verify forward whose kernels round differently from the decode forward may flip a
near-tie, as a recompute after preemption already may.)

A draft model (`tandem.engine.draft`) draws its proposals with `sample` under the request's seed at each
proposal's output position: sharing the exponential race's noise with the target's draw makes exact-match
acceptance nearly that of rejection sampling (on a 50-token vocabulary, 0.59 against 0.63 where independent draws
match 0.10), so identical output costs little acceptance.

`rejection_sample` is the standard rule (Leviathan et al. 2023; Chen et al. 2023) for proposals a draft
model sampled from its own distribution q: accept x with probability min(1, p(x) / q(x)), else draw from
max(0, p - q) normalised. The emitted tokens follow the target's distribution p, but are not the tokens
non-speculative decoding would emit; its random numbers still come from the counter-based generator
(its own streams of the request's seed), so it too is reproducible and placement-free given the proposals.
The engine uses it for a draft model's proposals of unseeded requests sampled with temperature > 0 only
(`verify_proposals`: exact match for every other request of the same step).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from tandem.common.config import ConfigError
from tandem.engine.request import RequestStatus
from tandem.engine.sampler import SamplingTensors, _truncate, sample, uniform_noise

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
    "prompt_lookup_min": M} or {"method": "draft_model", "model": NAME, "num_speculative_tokens": K}; either with
    "disable_by_batch_size": B (no proposals while B or more requests are running)."""

    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix looked up (resolved in __post_init__, never None after it).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: the draft's model name (a preset, a local HF folder, dummy:<shape>); same vocabulary.
    model: str | None = None
    # No proposals in a step while this many requests or more are running: a large batch is compute-bound, and
    # verifying proposals there costs more than the forwards it saves (vLLM's key; None: always speculate).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method: unsupported speculative method {self.method!r} ({', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ConfigError(f"disable_by_batch_size must be an integer >= 1 (or absent), got {b!r}")
        if self.method == "ngram":
            self._check_ngram()
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(f"model: the draft_model method needs the draft's model name, got {self.model!r}")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}: only the ngram method looks up the prompt")

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ConfigError(f"model: the ngram method uses no draft model, got {self.model!r}")
        # As vLLM: one bound given sets the other, neither gives 5 and 5.
        given = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min
        lookup_max = self.prompt_lookup_max if self.prompt_lookup_max is not None else given
        lookup_min = self.prompt_lookup_min if self.prompt_lookup_min is not None else given
        resolved: dict[str, int] = {}
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            value = 5 if value is None else value
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
            resolved[name] = value
            object.__setattr__(self, name, value)
        if resolved["prompt_lookup_min"] > resolved["prompt_lookup_max"]:
            raise ConfigError(f"prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max})")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict. As vLLM: without "method", a "model" of "ngram" (or "[ngram]") means ngram and any
        other model a draft model; "[ngram]" is ngram. Keys tandem does not honour are refused, by name."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unsupported key(s) {', '.join(map(repr, unknown))} "
                              f"(supported: {', '.join(sorted(known))})")
        kwargs = dict(values)
        if "num_speculative_tokens" not in kwargs:
            raise ConfigError("num_speculative_tokens: required")
        method, model = kwargs.get("method"), kwargs.get("model")
        if method is None:
            if model is None:
                raise ConfigError("method: required (ngram or draft_model), or a draft model's name in model")
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method == "ngram" and model in ("ngram", "[ngram]"):
            kwargs.pop("model")
        kwargs["method"] = method
        return cls(**kwargs)


# -- verification -------------------------------------------------------------------------------------------

@dataclass
class VerifyOutput:
    """One verify step's result on the logits' device. Row s emitted num_accepted[s] + 1 tokens:
    token_ids[s, :num_accepted[s] + 1]; the rest of the row is -1 (logprob 0)."""

    num_accepted: torch.Tensor  # [S] int64
    token_ids: torch.Tensor  # [S, K+1] int64
    logprobs: torch.Tensor  # [S, K+1] float32: the emitted tokens' logprobs under the raw logits

    def tolist(self) -> tuple[list[list[int]], list[list[float]]]:
        """Each request's emitted token ids and logprobs, as host lists (the step's host sync)."""
        token_rows, logprob_rows = self.token_ids.tolist(), self.logprobs.tolist()
        counts = [sum(1 for t in row if t >= 0) for row in token_rows]
        return ([row[:n] for row, n in zip(token_rows, counts, strict=True)],
                [row[:n] for row, n in zip(logprob_rows, counts, strict=True)])


def pad_proposals(proposals: Sequence[Sequence[int]], num_speculative_tokens: int,
                  device: torch.device) -> torch.Tensor:
    """Host proposal lists (each at most K long, maybe empty) → [S, K] int64 on `device`, -1 after each."""
    padded = [list(p) + [-1] * (num_speculative_tokens - len(p)) for p in proposals]
    assert all(len(p) == num_speculative_tokens for p in padded), "a proposal is longer than K"
    host = torch.tensor(padded, dtype=torch.int64).reshape(len(padded), num_speculative_tokens)
    return host.to(device, non_blocking=True)


@dataclass
class _Rows:
    """Where each request's k + 1 logits rows are. Packed logits hold sum(k_s + 1) rows, request by request;
    padded [S, K+1, V] logits are the packed case with every k_s = K (rows past a short proposal are computed
    and ignored: their proposal -1 never matches, so num_accepted <= k_s)."""

    logits: torch.Tensor  # [T, V]
    seq_of_row: torch.Tensor  # [T] int64: the request of each row
    offset_of_row: torch.Tensor  # [T] int64: j, the row's index within its request
    index: torch.Tensor  # [S, K+1] int64: packed row of (s, j), clamped to the request's last row past k_s

    @classmethod
    def of(cls, logits: torch.Tensor, proposals: torch.Tensor) -> _Rows:
        num_seqs, k = proposals.shape
        device = logits.device
        if logits.dim() == 3:
            assert logits.shape[:2] == (num_seqs, k + 1), f"logits {tuple(logits.shape)}, proposals {(num_seqs, k)}"
            counts = torch.full((num_seqs,), k + 1, dtype=torch.int64, device=device)
            logits = logits.reshape(num_seqs * (k + 1), -1)
        else:
            assert logits.dim() == 2, f"logits must be [T, V] or [S, K+1, V], got {tuple(logits.shape)}"
            counts = (proposals >= 0).sum(dim=1) + 1  # the caller's contract: T == counts.sum()
        starts = torch.cumsum(counts, 0) - counts  # [S]
        # output_size spares the host sync that sizing the result would cost on a GPU.
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts,
                                             output_size=logits.shape[0])
        offset_of_row = torch.arange(logits.shape[0], device=device) - starts[seq_of_row]
        j = torch.arange(k + 1, device=device)[None, :]
        index = starts[:, None] + torch.minimum(j, counts[:, None] - 1)
        return cls(logits, seq_of_row, offset_of_row, index)

    def sampling_tensors(self, tensors: SamplingTensors | None) -> SamplingTensors | None:
        """The requests' sampling parameters per row; row j draws output position positions[s] + j."""
        if tensors is None:
            return None
        rows = self.seq_of_row
        return replace(tensors, temperatures=tensors.temperatures[rows], top_ks=tensors.top_ks[rows],
                       top_ps=tensors.top_ps[rows], seeds=tensors.seeds[rows],
                       positions=tensors.positions[rows] + self.offset_of_row)


def _accepted_run(is_accepted: torch.Tensor) -> torch.Tensor:
    """[S, K] bool → [S] int64: the length of each row's leading run of accepted proposals."""
    return is_accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _emitted(token_ids: torch.Tensor, logprobs: torch.Tensor, num_accepted: torch.Tensor) -> VerifyOutput:
    """Keep columns 0..num_accepted of [S, K+1] tokens and logprobs; -1 and 0 after them."""
    is_kept = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :] <= num_accepted[:, None]
    return VerifyOutput(num_accepted, token_ids.masked_fill(~is_kept, -1), logprobs.masked_fill(~is_kept, 0.0))


def verify(logits: torch.Tensor, proposals: torch.Tensor, tensors: SamplingTensors | None) -> VerifyOutput:
    """Exact-match verification: output identical to one-token-at-a-time decoding (module docstring).

    logits: [S, K+1, V], or packed [sum(k_s + 1), V] (request s's rows in order, k_s its proposals);
    proposals: [S, K] int64, -1 after each request's k_s proposals (`pad_proposals`); tensors: the requests'
    `SamplingTensors` with `positions` the output position of row 0 (num_output_tokens), None when all are
    greedy. A request with no proposals is a plain decode row, so one call can sample a whole mixed step.
    """
    rows = _Rows.of(logits, proposals)
    token_ids, logprobs = sample(rows.logits, rows.sampling_tensors(tensors))  # [T]: the target's own tokens
    target_ids = token_ids[rows.index]  # [S, K+1]
    num_accepted = _accepted_run(target_ids[:, :-1] == proposals)  # a -1 pad never matches
    return _emitted(target_ids, logprobs[rows.index], num_accepted)


# -- rejection sampling (draft-model proposals) -------------------------------------------------------------

# The streams of a request's seed that rejection sampling draws from, apart from the sampler's own (XORed
# into the seed; both below 2^63, so plain int64 constants).
_ACCEPT_STREAM = 0x5EC0DE0000000001
_RESIDUAL_STREAM = 0x5EC0DE0000000002


def target_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """[T, V] logits → the distribution `sample` draws from: temperature, then top-k and top-p; one-hot
    argmax for a greedy row. Mirrors the first lines of `sample` (see the report: the sampler could expose
    this as one public function that both use)."""
    is_greedy = tensors.temperatures == 0.0
    scaled = logits / torch.where(is_greedy, 1.0, tensors.temperatures)[:, None]
    if tensors.any_top_k or tensors.any_top_p:
        scaled = _truncate(scaled, tensors)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(is_greedy[:, None], one_hot, probs)


def rejection_sample(logits: torch.Tensor, proposals: torch.Tensor, draft_probs: torch.Tensor,
                     tensors: SamplingTensors | None) -> VerifyOutput:
    """Speculative sampling: the emitted tokens follow the target's distribution whatever q is.

    logits and proposals as in `verify`; draft_probs [S, K, V]: the distribution q the draft sampled
    proposal j from (after the request's temperature, top-k and top-p; rows past k_s are ignored). A greedy
    request is exact match (p is one-hot: x is accepted iff it is the argmax), and so is an all-greedy step.
    Each random number that can shape the output is used once: acceptance and residual draws have streams of
    their own, keyed by output position like the sampler's, and the token after a fully accepted run is the
    sampler's own draw there (so a request without proposals gets exactly `sample`'s token).
    """
    num_seqs, k = proposals.shape
    if tensors is None or k == 0:
        return verify(logits, proposals, tensors)
    rows = _Rows.of(logits, proposals)
    row_tensors = rows.sampling_tensors(tensors)
    assert row_tensors is not None
    p = target_probs(rows.logits, row_tensors)[rows.index]  # [S, K+1, V]
    num_proposals = (proposals >= 0).sum(dim=1)  # [S]
    x = proposals.clamp(min=0)[..., None]  # [S, K, 1]
    p_x = p[:, :k].gather(2, x).squeeze(2)  # [S, K]
    q_x = draft_probs.gather(2, x).squeeze(2).to(p.dtype)
    j = torch.arange(k + 1, device=logits.device)[None, :]  # [1, K+1]
    positions = tensors.positions[:, None] + j[:, :k]  # [S, K]
    seeds = tensors.seeds[:, None].expand_as(positions)
    u = uniform_noise((seeds ^ _ACCEPT_STREAM).reshape(-1), positions.reshape(-1), 1).reshape(num_seqs, k)
    # Accept with probability min(1, p/q): u < p/q, written without dividing (q may underflow to 0).
    num_accepted = _accepted_run((proposals >= 0) & (u * q_x < p_x))
    # At a rejected row, draw from the residual max(0, p - q) (the exponential race needs no normalising;
    # p == q leaves none, and then no rejection bar rounding: fall back to p).
    seq_ids = torch.arange(num_seqs, device=logits.device)
    p_row = p[seq_ids, num_accepted]  # [S, V]
    residual = (p_row - draft_probs[seq_ids, num_accepted.clamp(max=k - 1)].to(p.dtype)).clamp(min=0.0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_row)
    noise = uniform_noise(tensors.seeds ^ _RESIDUAL_STREAM, tensors.positions + num_accepted, p.shape[-1])
    resampled = (residual / -torch.log(noise)).argmax(dim=1)  # [S]
    bonus, _ = sample(rows.logits[rows.index[seq_ids, num_proposals]],
                      replace(tensors, positions=tensors.positions + num_proposals))
    last = torch.where(num_accepted < num_proposals, resampled, bonus)
    padded = torch.cat([proposals, proposals.new_full((num_seqs, 1), -1)], dim=1)
    token_ids = torch.where(j == num_accepted[:, None], last[:, None], padded)  # [S, K+1]
    # Each row's logprob of its emitted token, under the raw logits (as `sample` reports it).
    row_token_ids = token_ids[rows.seq_of_row, rows.offset_of_row].clamp(min=0)  # [T]
    row_logprobs = (rows.logits.gather(1, row_token_ids[:, None]).squeeze(1)
                    - torch.logsumexp(rows.logits, dim=-1))
    return _emitted(token_ids, row_logprobs[rows.index], num_accepted)


def select_requests(tensors: SamplingTensors, index: torch.Tensor) -> SamplingTensors:
    """The sampling parameters of the requests at `index` [s]."""
    return replace(tensors, temperatures=tensors.temperatures[index], top_ks=tensors.top_ks[index],
                   top_ps=tensors.top_ps[index], seeds=tensors.seeds[index], positions=tensors.positions[index])


def verify_proposals(logits: torch.Tensor, proposals: torch.Tensor, tensors: SamplingTensors | None,
                     draft_probs: Sequence[torch.Tensor | None]) -> VerifyOutput:
    """One verify step over requests verified two ways: `rejection_sample` for those whose proposals carry the
    distribution the draft model drew them from (`draft_probs[s]`, [>= k_s, V]: an unseeded request sampled with
    temperature > 0), exact match (`verify`) for every other (greedy, seeded, n-gram proposals).

    Arguments as `verify`'s. The exact-match result is computed for every request (the rows of the others are then
    overwritten): the sampler's pass over the step's logits is cheap next to the forward that made them.
    """
    exact = verify(logits, proposals, tensors)
    chosen = [s for s, q in enumerate(draft_probs) if q is not None]
    if tensors is None or not chosen:
        return exact
    num_seqs, k = proposals.shape
    device = logits.device
    index = torch.tensor(chosen, dtype=torch.int64, device=device)
    # Their rows, padded to [s, K+1, V] (a request's rows past k_s repeat its last one: ignored).
    rows = _Rows.of(logits, proposals)
    q = torch.zeros(len(chosen), k, logits.shape[-1], dtype=torch.float32, device=device)
    for row, s in enumerate(chosen):
        probs = draft_probs[s]
        assert probs is not None
        q[row, :min(k, probs.shape[0])] = probs[:k]
    rejected = rejection_sample(rows.logits[rows.index[index]], proposals[index], q, select_requests(tensors, index))
    num_accepted, token_ids, logprobs = exact.num_accepted.clone(), exact.token_ids.clone(), exact.logprobs.clone()
    num_accepted[index] = rejected.num_accepted
    token_ids[index] = rejected.token_ids
    logprobs[index] = rejected.logprobs
    return VerifyOutput(num_accepted, token_ids, logprobs)


# -- stop rules inside a verified run -----------------------------------------------------------------------

def truncate_at_stop(token_ids: Sequence[int], num_output_tokens: int, max_tokens: int,
                     stop_token_ids: Collection[int]) -> tuple[int, RequestStatus | None]:
    """How many of a verified run's tokens one-at-a-time decoding would have emitted, and how it would end.

    `num_output_tokens`: the request's output before the run; `stop_token_ids`: its stop ids plus the model's
    EOS ids unless `ignore_eos`. As `Scheduler._stop_status` on each token in turn: a stop id ends the request
    (kept, FINISHED_STOPPED) before max_tokens does (FINISHED_LENGTH); the tokens after are dropped.
    """
    for i, token_id in enumerate(token_ids):
        if token_id in stop_token_ids:
            return i + 1, RequestStatus.FINISHED_STOPPED
        if num_output_tokens + i + 1 >= max_tokens:
            return i + 1, RequestStatus.FINISHED_LENGTH
    return len(token_ids), None

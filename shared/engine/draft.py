"""Draft-model proposals for speculative decoding: a second (smaller) model of the same vocabulary proposes the
next K tokens, the target verifies them in its next step (`tandem.engine.spec_decode`).

The draft is a `ModelRunner` of its own (weights, paged KV cache, CUDA graphs for its decode steps) whose pool
mirrors the target's block for block: the same block size and the same block ids, so a request's block table
addresses its draft K/V too and no second allocator is needed. The pool has one extra strip of scratch blocks per
batch row past the target's (`ceil(K / block_size)` each) for the positions past the request's last block (its
last token's, before the target's next step allocates it, and the proposals'); those are valid only within one
round.

A round (after every engine step, for the requests that decode):
1. catch-up: the draft computes the request's tokens it has not seen (a chunk through the paged prefill path:
   the whole prompt the first time, then the target's token(s) of the last step, and the accepted proposals whose
   draft K/V went to a scratch block), all requests in one forward; catch-ups longer than K + 1 tokens (prompts)
   get at most the step's token budget in all, fewest pending first, and a request that gets only part of its
   catch-up proposes nothing this round;
2. K - 1 decode steps, batched over the requests still proposing (sorted by k, so each step's batch is a prefix
   of the previous one's), through the draft runner's CUDA graphs where it has them.
Each proposal is drawn by `sampler.sample` from the draft's logits with the request's temperature, top-k and
top-p and its counter-based generator at that output position: greedy proposals are the draft's argmax, and a
seeded (or greedy) proposal is accepted exactly when it equals the target's own token there, so the output is the
output of decoding one token at a time. For an unseeded request sampled with temperature > 0 the proposals also
carry the distribution they were drawn from (`Request.spec_draft_probs`), and the verify step rejection-samples
them (the target's distribution, higher acceptance than exact match).

Rollback is free: the draft remembers, per request, how many leading positions of its blocks hold the draft's
K/V of the request's actual tokens; after a verify step that prefix extends over the accepted proposals, and the
rejected ones' slots are simply overwritten by the next catch-up. A preempted request (its blocks are new) starts
over. Prefix-cache hits are not trusted (a shared block's draft K/V may never have been computed): a new request's
draft computes its whole prompt, which is also where a disaggregated decode worker's draft K/V come from (the
prefill worker ships the target's pages only); those tokens are counted (`last_num_prompt_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

import torch

from tandem.common.config import ConfigError, EngineConfig, ModelConfig
from tandem.engine.kv_cache import bytes_per_block, kv_cache_dtype
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.runner import DecodeInputs, ModelRunner, host_tensor, select_ops
from tandem.engine.sampler import SamplingTensors, sample
from tandem.engine.spec_decode import SpeculativeConfig, select_requests, target_probs


def num_scratch_blocks_per_seq(num_speculative_tokens: int, block_size: int) -> int:
    """Blocks past a request's own that a round may write: a request of L tokens has blocks for at least its first
    L - 1 (the target computed those), and the round writes positions up to L + K - 2."""
    return -(-num_speculative_tokens // block_size)


def draft_engine_config(target: EngineConfig, speculative: SpeculativeConfig, draft: ModelConfig) -> EngineConfig:
    """The draft runner's config: the target's device, dtype, block size, KV dtype and context, the draft's model
    (unquantized). Refuses a draft that cannot propose the target's tokens, naming `model`."""
    name = speculative.model
    if draft.vocab_size != target.model.vocab_size:
        raise ConfigError(f"model: the draft model {name!r} has a vocabulary of {draft.vocab_size} tokens and the "
                          f"target {target.model.name!r} one of {target.model.vocab_size}; speculative decoding needs "
                          f"the same vocabulary (the same tokenizer)")
    if draft.max_position_embeddings < target.max_model_len:
        raise ConfigError(f"model: the draft model {name!r} has a context of {draft.max_position_embeddings} "
                          f"tokens, below max_model_len ({target.max_model_len})")
    return replace(target, model=draft, cache=replace(target.cache, enable_prefix_caching=False),
                   scheduler=replace(target.scheduler, max_model_len=target.max_model_len))


def draft_kv_share(config: EngineConfig, speculative: SpeculativeConfig) -> tuple[int, int]:
    """What the draft takes out of the target's KV budget (`num_blocks_to_allocate`): bytes per mirrored block, and
    bytes to reserve (its scratch blocks; on a GPU also its weights, which are loaded after the target's pool is
    sized)."""
    device = torch.device(config.device)
    dtype: torch.dtype = getattr(torch, config.resolved_dtype)
    per_block = bytes_per_block(config.model, config.cache.block_size, kv_cache_dtype(config.cache, dtype, device))
    num_scratch = config.scheduler.max_num_seqs * num_scratch_blocks_per_seq(speculative.num_speculative_tokens,
                                                                             config.cache.block_size)
    reserved = num_scratch * per_block
    if device.type == "cuda":
        with torch.device("meta"):
            shape = LlamaForCausalLM(config.model, select_ops(config))
        reserved += sum(p.numel() for p in shape.parameters()) * torch.empty(0, dtype=dtype).element_size()
    return per_block, reserved


@dataclass(eq=False)
class _DraftState:
    """What the draft's pool holds for one request: its K/V of the request's tokens at positions [0, num_valid) in
    the request's blocks, and of `spec_tokens` (last round's proposals) from `num_valid` on."""

    request: Request
    num_preemptions: int
    num_valid: int = 0
    spec_tokens: list[int] = field(default_factory=list)


@dataclass(eq=False)
class _DraftView:
    """What `ModelRunner.chunk_logits` reads of a request, with the draft's block table (its blocks, then scratch)."""

    request: Request
    block_ids: list[int]
    is_prefilling: bool = False
    kv_mirror: None = None
    table_row: tuple[list[int], bytes] | None = None  # `runner.table_row`'s cache (a view lives one step)

    def token_ids_from(self, start: int, num: int) -> list[int]:
        request = self.request
        prompt = request.prompt_token_ids
        return (prompt[start:start + num] + request.output_token_ids[max(0, start - len(prompt)):
                                                                     max(0, start + num - len(prompt))])


@dataclass
class _Row:
    request: Request
    k: int  # proposals to make
    start: int  # first position the catch-up computes
    num_new: int  # positions it computes
    proposes: bool  # all caught up: logits at its last token, then proposals


class DraftProposer:
    """Proposes with a draft model whose KV pool mirrors the target's block ids (module docstring)."""

    def __init__(self, speculative: SpeculativeConfig, config: EngineConfig, num_blocks: int) -> None:
        """`config`: the draft runner's (`draft_engine_config`); `num_blocks`: the target's pool."""
        assert speculative.method == "draft_model", speculative.method
        self.num_speculative_tokens = speculative.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.scratch_per_seq = num_scratch_blocks_per_seq(self.num_speculative_tokens, self.block_size)
        total = num_blocks + self.max_num_seqs * self.scratch_per_seq
        self.runner = ModelRunner(replace(config, cache=replace(config.cache, num_blocks=total)))
        self.device = self.runner.device
        # Catch-up tokens of long catch-ups (a prompt) per round, at most: several rounds, as chunked prefill would.
        self.max_catchup_tokens = config.budget
        self._states: dict[str, _DraftState] = {}
        # Counters (a round's, read by the engine after `propose`): tokens the draft computed, and how many of them
        # were prompt tokens (computed locally on a decode worker, whatever computed the target's).
        self.last_num_tokens = 0
        self.last_num_prompt_tokens = 0

    # -- per-request state -----------------------------------------------------------------------------------
    def _state(self, request: Request) -> _DraftState:
        """The request's state, its valid prefix extended over last round's proposals that were accepted."""
        state = self._states.get(request.req_id)
        if state is None or state.request is not request or state.num_preemptions != request.num_preemptions:
            state = self._states[request.req_id] = _DraftState(request, request.num_preemptions)
            return state
        num_tokens = request.num_tokens
        for token_id in state.spec_tokens:
            if state.num_valid >= num_tokens or _token_at(request, state.num_valid) != token_id:
                break
            state.num_valid += 1
        state.spec_tokens = []
        # The last token is always computed again: its logits give the first proposal.
        state.num_valid = min(state.num_valid, num_tokens - 1)
        return state

    def forget(self, req_id: str) -> None:
        """The request ended (its blocks are freed): drop what the draft knew of it."""
        self._states.pop(req_id, None)

    def _forget_finished(self) -> None:
        for req_id in [i for i, s in self._states.items() if s.request.status.is_finished]:
            del self._states[req_id]

    # -- a round -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, candidates: list[tuple[Request, int]]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """For each (request, k): up to k proposals (none while its catch-up is incomplete), and the distribution
        they were drawn from ([k, V] on the device) for an unseeded request sampled with temperature > 0, else None.
        """
        self._forget_finished()
        self.last_num_tokens = self.last_num_prompt_tokens = 0
        proposals: list[list[int]] = [[] for _ in candidates]
        probs: list[torch.Tensor | None] = [None] * len(candidates)
        if not candidates:
            return proposals, probs
        states = [self._state(request) for request, _ in candidates]
        # The steady state (at most K + 1 pending tokens: the accepted proposals and the target's token) always;
        # longer catch-ups (a prompt) within the step's token budget, fewest pending tokens first.
        rows: dict[int, _Row] = {}
        budget = self.max_catchup_tokens
        for i in sorted(range(len(candidates)), key=lambda i: candidates[i][0].num_tokens - states[i].num_valid):
            request, k = candidates[i]
            pending = request.num_tokens - states[i].num_valid
            if pending <= self.num_speculative_tokens + 1:
                rows[i] = _Row(request, k, states[i].num_valid, pending, proposes=True)
                continue
            if budget <= 0:
                break
            num_new = min(pending, budget)
            rows[i] = _Row(request, k, states[i].num_valid, num_new, proposes=num_new == pending)
            budget -= num_new
        # Proposing rows by k, largest first (each decode step runs a prefix of them), then the partial catch-ups;
        # row m writes past the request's blocks into scratch strip m.
        order = sorted((i for i in rows if rows[i].proposes), key=lambda i: -rows[i].k)
        catchup = [rows[i] for i in order] + [row for row in rows.values() if not row.proposes]
        tables = [row.request.block_ids + self._scratch(m, row) for m, row in enumerate(catchup)]
        logits = self._catch_up(catchup, tables)
        for i, row in rows.items():
            # What lies in the request's own blocks stays valid; what went to scratch is computed again next round.
            states[i].num_valid = min(row.start + row.num_new, len(row.request.block_ids) * self.block_size)
            self.last_num_tokens += row.num_new
            self.last_num_prompt_tokens += max(0, min(row.start + row.num_new, row.request.num_prompt_tokens)
                                               - row.start)
        if not order:
            return proposals, probs
        drafted, drawn_from = self._decode(catchup[:len(order)], tables, logits)
        for m, i in enumerate(order):
            row = rows[i]
            proposals[i], probs[i] = drafted[m], drawn_from[m]
            # The first k - 1 proposals' K/V are written from position L on; those in the request's own blocks stay
            # valid if they are accepted.
            room = len(row.request.block_ids) * self.block_size - row.request.num_tokens
            states[i].spec_tokens = drafted[m][:max(0, min(row.k - 1, room))]
        return proposals, probs

    def _catch_up(self, rows: list[_Row], tables: list[list[int]]) -> torch.Tensor:
        """Compute each row's pending tokens into the draft's pool (row m's block table `tables[m]`); logits [P, V]
        at the last token of each of the first P rows, those that propose."""
        num_logits = [1 if row.proposes else 0 for row in rows]
        if all(row.num_new == 1 for row in rows):  # the steady state after a rejection: a decode step
            input_ids = [_token_at(row.request, row.start) for row in rows]
            return self._forward_decode(tables, [row.start for row in rows], input_ids)[:sum(num_logits)]
        # chunk_logits attends the leading one-token chunks through the decode kernel: put them first.
        single = [j for j, row in enumerate(rows) if row.num_new == 1]
        multi = [j for j, row in enumerate(rows) if row.num_new > 1]
        chunks = [(cast(Request, _DraftView(rows[j].request, tables[j])), rows[j].start, rows[j].num_new)
                  for j in single + multi]
        logits = self.runner.chunk_logits(chunks, [num_logits[j] for j in single + multi])
        # Back to the rows' order: the proposing rows' logits, in order.
        position = {j: p for p, j in enumerate(j for j in single + multi if num_logits[j])}
        order = [position[j] for j in range(len(rows)) if num_logits[j]]
        return logits[torch.tensor(order, dtype=torch.int64, device=self.device)]

    def _decode(self, rows: list[_Row], tables: list[list[int]], logits: torch.Tensor
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draw the rows' proposals (rows sorted by k, largest first; `logits` at each one's last token): the first
        from `logits`, then one draft decode step per further proposal. One host sync at the end."""
        requests = [row.request for row in rows]
        tensors = SamplingTensors.from_requests(requests, self.device)
        # Rows whose proposals will be rejection-sampled: unseeded, sampled with temperature > 0.
        keep_q = [m for m, r in enumerate(requests) if r.params.seed is None and r.params.temperature > 0.0]
        drawn: list[torch.Tensor] = []
        q_steps: list[torch.Tensor] = []
        for j in range(rows[0].k):
            size = sum(1 for row in rows if row.k > j)
            if j > 0:  # the previous proposals in, at positions L + j - 1
                positions = [row.request.num_tokens + j - 1 for row in rows[:size]]
                logits = self._forward_decode(tables[:size], positions, drawn[-1][:size])
            step_tensors = _rows(tensors, size, j)
            token_ids, _ = sample(logits, step_tensors)
            drawn.append(token_ids)
            q_rows = [m for m in keep_q if m < size]
            if q_rows:
                assert step_tensors is not None
                index = torch.tensor(q_rows, dtype=torch.int64, device=self.device)
                q_steps.append(target_probs(logits[index], select_requests(step_tensors, index)))
            self.last_num_tokens += size if j > 0 else 0
        flat = torch.cat(drawn).tolist()  # the round's one host sync
        proposals: list[list[int]] = [[] for _ in rows]
        offset = 0
        for token_ids in drawn:
            for m in range(token_ids.shape[0]):
                proposals[m].append(flat[offset + m])
            offset += token_ids.shape[0]
        probs: list[torch.Tensor | None] = [None] * len(rows)
        for n, m in enumerate(keep_q):
            probs[m] = torch.stack([q_steps[j][n] for j in range(rows[m].k)])
        return proposals, probs

    def _scratch(self, m: int, row: _Row) -> list[int]:
        """Row m's scratch blocks that the round reaches (positions up to L + k - 2 if it proposes)."""
        end = row.request.num_tokens + row.k - 1 if row.proposes else row.start + row.num_new
        needed = -(-end // self.block_size) - len(row.request.block_ids)
        first = self.num_blocks + m * self.scratch_per_seq
        assert needed <= self.scratch_per_seq and m < self.max_num_seqs, (needed, m)
        return list(range(first, first + max(0, needed)))

    def _forward_decode(self, tables: list[list[int]], positions: list[int],
                        input_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """One draft decode step: row s computes token `input_ids[s]` (host ids, or [S] on the device) at
        `positions[s]` with block table `tables[s]` → logits [S, V]."""
        bs = self.block_size
        width = max(len(table) for table in tables)
        decode = DecodeInputs(
            input_ids=input_ids if isinstance(input_ids, torch.Tensor) else self._host(input_ids, torch.int64),
            positions=self._host(positions, torch.int64),
            slot_mapping=self._host([t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)],
                                    torch.int64),
            block_tables=self._host([table + [0] * (width - len(table)) for table in tables], torch.int32),
            context_lens=self._host([p + 1 for p in positions], torch.int32))
        graphs = self.runner.graphs
        if graphs is not None and graphs.can_run(len(tables)):
            return graphs.run(decode)  # a view of the graph's output: used before the next replay
        return self.runner.forward_decode(decode.to(self.device), self.runner.num_splits_for(len(tables)))

    def _host(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return host_tensor(values, dtype, pin=self.device.type == "cuda")


def _token_at(request: Request, position: int) -> int:
    num_prompt = request.num_prompt_tokens
    if position < num_prompt:
        return request.prompt_token_ids[position]
    return request.output_token_ids[position - num_prompt]


def _rows(tensors: SamplingTensors | None, size: int, offset: int) -> SamplingTensors | None:
    """The first `size` rows' parameters, drawing output position + `offset`."""
    if tensors is None:
        return None
    return replace(tensors, temperatures=tensors.temperatures[:size], top_ks=tensors.top_ks[:size],
                   top_ps=tensors.top_ps[:size], seeds=tensors.seeds[:size],
                   positions=tensors.positions[:size] + offset)


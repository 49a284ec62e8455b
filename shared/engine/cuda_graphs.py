"""CUDA graphs: whole decode steps, and the pieces of steps with prompt tokens.

A small model's decode step is dozens of kernel launches per layer; replaying a captured graph
replaces them with one launch. `DecodeGraphs`: one graph per batch-size bucket. Constraints respected
here: the inputs live in static buffers (block tables sized to the maximum model length), the
context-split count is fixed per graph, and the kernels are warmed up (Triton compiled/autotuned)
before capture.

`PiecewiseGraphs`: a step with prompt tokens (chunks, mixed batches, verify steps) changes its prompt attention's
shape every step (how many chunks, how long, where they start), so it is not captured whole. Everything else is
captured: the model's N + 1 pieces between attentions (`LlamaForCausalLM.piece`, per token) by token-count bucket,
and the leading decode tokens' attention (one graph per layer and decode batch bucket, as in a decode step); only
the prompt chunks' attention runs eagerly between the replays. Measured on an H200 (`tandem.benchmarks.step_cost`,
llama-3.1-8b shapes): an eager step with prompt tokens spent 12-28 ms on the host launching kernels, more than its
GPU time up to ~1,000 tokens; with the pieces captured, the decode tokens' attention (a split kernel and its combine
per layer) still cost ~7 ms of it.

Both kinds time their graphs once captured and send each size to the cheapest bucket that holds it
(`cheapest_buckets`): cuBLAS picks its GEMM by shape, and some shapes get a poor pick. On an H200 (llama-3.1-8b,
benchmarks/results/h200-2026-12-02d/) the 448-token pieces took 15.7 ms against 13.0 for the 512-token ones: the
gate/up projection ran a 512x64 tile at 0.27 ms a layer instead of a 168x128 one at 0.12 ms.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.attention import AttentionMetadata
    from tandem.engine.runner import DecodeInputs, ModelRunner

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Token counts of piecewise graphs, up to PIECEWISE_MAX_TOKENS: steps with more tokens run eagerly. On an H200
# (llama-3.1-8b, benchmarks/results/h200-2026-12-02/step-cost-8b-*.json) an eager step spends 12-26 ms launching
# kernels whatever its size; its GPU time passes that near 1,000 tokens, and past it the graphs' padding to a bucket
# and their copies made steps 3-8% slower than eager ones (2,064 tokens padded to 2,304: 56.7 vs 52.4 ms).
TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256, *range(320, 1025, 64))
PIECEWISE_MAX_TOKENS = TOKEN_BUCKETS[-1]
# "0": every size replays its own bucket, however slow (the A/B switch of the benchmarks).
BUCKETS_BY_TIME_ENV = "TANDEM_GRAPH_BUCKETS_BY_TIME"
# A larger bucket takes a size only if its replay is this much faster: timing noise does not add padding.
_FASTER_BY = 0.97

logger = logging.getLogger(__name__)


def cheapest_buckets(buckets: Sequence[int], times_ms: Mapping[int, float]) -> dict[int, int]:
    """For each bucket (ascending), the bucket at least as large to replay instead: the one whose replay measured
    fastest, itself unless a larger one ran at least 3% faster."""
    route: dict[int, int] = {}
    best: int | None = None
    for size in reversed(buckets):
        if best is None or times_ms[best] >= _FASTER_BY * times_ms[size]:
            best = size
        route[size] = best
    return route


def time_replays(replays: Sequence[Callable[[], object]], repeat: int = 5) -> float:
    """Median GPU milliseconds of one pass over `replays` (after one untimed pass)."""
    for replay in replays:
        replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for replay in replays:
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class BucketRoute:
    """Which captured bucket a size replays: the smallest that holds it, or a larger one measured faster."""

    def __init__(self, buckets: Sequence[int]) -> None:
        self.buckets = list(buckets)
        self.times_ms: dict[int, float] = {}
        self.route = {b: b for b in self.buckets}

    def __call__(self, size: int) -> int:
        return self.route[next(b for b in self.buckets if b >= size)]

    def exact_sizes(self) -> tuple[int, ...]:
        """The sizes that replay their own bucket: a step of exactly that many tokens needs no padding."""
        return tuple(size for size in self.buckets if self.route[size] == size)

    def measure(self, replays: Mapping[int, Sequence[Callable[[], object]]], what: str) -> None:
        """Time every bucket's replays (the GPU idle, at start-up) and route by the times; logs what moved."""
        if os.environ.get(BUCKETS_BY_TIME_ENV, "1") == "0":
            return
        self.times_ms = {size: time_replays(replays[size]) for size in self.buckets}
        self.route = cheapest_buckets(self.buckets, self.times_ms)
        moved = [f"{size} -> {to} ({self.times_ms[size]:.2f} -> {self.times_ms[to]:.2f} ms)"
                 for size, to in self.route.items() if to != size]
        if moved:
            logger.info("%s: sizes replay a larger bucket measured faster: %s", what, ", ".join(moved))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch_size: int) -> None:
        from tandem.engine.runner import DecodeInputs

        self.runner = runner
        self.buckets = [b for b in BUCKETS if b <= max_batch_size] or [1]
        self.bucket = BucketRoute(self.buckets)
        size = self.buckets[-1]
        device = runner.device
        # Padding rows: token 0 at position 0, slot -1 (store skipped), context 0 (zero output).
        self.static = DecodeInputs(
            input_ids=torch.zeros(size, dtype=torch.int64, device=device),
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(size, runner.max_blocks_per_seq, dtype=torch.int32, device=device),
            context_lens=torch.zeros(size, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: object | None = None  # the graphs' shared memory pool, from the first capture

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def _view(self, size: int) -> DecodeInputs:
        from tandem.engine.runner import DecodeInputs

        s = self.static
        return DecodeInputs(s.input_ids[:size], s.positions[:size], s.slot_mapping[:size],
                            s.block_tables[:size], s.context_lens[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse its memory pool.
        for size in reversed(self.buckets):
            inputs = self._view(size)
            num_splits = self.runner.num_splits_for(size)
            for _ in range(2):  # warm-up: compiles kernels, settles allocator state
                self.runner.forward_decode(inputs, num_splits)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):  # type: ignore[arg-type]
                self.outputs[size] = self.runner.forward_decode(inputs, num_splits)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.runner.device)
        # The static inputs are padding rows here (slot -1, context 0): the timed replays store nothing.
        self.bucket.measure({size: [graph.replay] for size, graph in self.graphs.items()}, "decode graphs")

    def run(self, inputs: DecodeInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the smallest graph that fits, with `inputs` (pinned host tensors, copied asynchronously
        straight into the static buffers; device tensors work too); `input_ids` (on the device) in place of
        theirs (async scheduling: the tokens of a step the host has not read yet)."""
        num_seqs = inputs.input_ids.shape[0]
        size = self.bucket(num_seqs)
        s = self.static
        s.input_ids[:num_seqs].copy_(inputs.input_ids if input_ids is None else input_ids, non_blocking=True)
        s.positions[:num_seqs].copy_(inputs.positions, non_blocking=True)
        s.slot_mapping[:num_seqs].copy_(inputs.slot_mapping, non_blocking=True)
        s.slot_mapping[num_seqs:size].fill_(-1)
        s.context_lens[:num_seqs].copy_(inputs.context_lens, non_blocking=True)
        s.context_lens[num_seqs:size].zero_()
        width = inputs.block_tables.shape[1]
        s.block_tables[:num_seqs, :width].copy_(inputs.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]


class PiecewiseGraphs:
    """The pieces of a step with prompt tokens, captured per token-count bucket (up to `max_tokens`, at most
    PIECEWISE_MAX_TOKENS), replayed with each layer's attention eager in between. Static buffers: the step's
    token ids, positions and KV slots (padding rows: token 0 at position 0, slot -1: nothing stored), and what
    crosses each attention: q, k, v, the residual stream and the attention's output. Padding rows compute garbage
    that no real row reads (pieces are per token) and that the attention never sees (it takes the first T rows)."""

    def __init__(self, runner: ModelRunner, max_tokens: int, max_decodes: int = 0) -> None:
        """`max_decodes`: the most decode tokens a step may lead with (graphs for their attention up to it, in the
        decode steps' batch buckets; 0: that attention runs eagerly)."""
        self.runner = runner
        model = runner.model
        cfg = runner.config.model
        limit = min(max_tokens, PIECEWISE_MAX_TOKENS)
        self.buckets = [b for b in TOKEN_BUCKETS if b < limit] + [next(b for b in TOKEN_BUCKETS if b >= limit)]
        self.bucket = BucketRoute(self.buckets)
        size = self.buckets[-1]
        self.decode_buckets = [b for b in BUCKETS if b <= min(max_decodes, size)]
        device, dtype = runner.device, runner.dtype
        num_q, num_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(size, num_q, head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(size, num_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(size, num_kv, head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(size, num_q, head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        # The decode tokens' pages (padding rows: context 0, a zero output that the prompt attention overwrites).
        max_seqs = self.decode_buckets[-1] if self.decode_buckets else 0
        self.block_tables = torch.zeros(max_seqs, runner.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.num_pieces = model.num_layers + 1
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.decode_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # What `run` calls per piece (and per layer's decode attention): the graphs' replays, or
        # (`use_eager_pieces`) the same work uncaptured.
        self.replays: dict[int, list[Callable[[], None]]] = {}
        self.decode_replays: dict[int, list[Callable[[], object]]] = {}
        self.pool: object | None = None

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.buckets[-1]

    def _piece(self, i: int, size: int) -> None:
        """Piece i over the first `size` rows of the static buffers, its results copied into them."""
        runner = self.runner
        hidden = self.input_ids[:size] if i == 0 else self.attn_out[:size].view(size, -1)
        result = runner.model.piece(i, hidden, self.residual[:size], self.positions[:size], self.slot_mapping[:size],
                                    runner.kv_layers, runner.cos_sin)
        if i + 1 == self.num_pieces:
            self.hidden[:size].copy_(result[0])
            return
        q, k, v, residual = result
        self.q[:size].copy_(q)
        self.k[:size].copy_(k)
        self.v[:size].copy_(v)
        self.residual[:size].copy_(residual)  # a no-op where the norm updated the static residual in place

    def _decode_attention(self, i: int, num_seqs: int) -> object:
        """Layer i's decode attention of the first `num_seqs` rows of the static buffers."""
        runner = self.runner
        return runner.model.attention(i).decode_attend(
            self.q[:num_seqs], runner.kv_layers[i], self.block_tables[:num_seqs], self.context_lens[:num_seqs],
            runner.num_splits_for(num_seqs), self.attn_out[:num_seqs])

    def _capture_one(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # type: ignore[arg-type]
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    @torch.inference_mode()
    def capture(self) -> None:
        device = self.runner.device
        self.context_lens.zero_()
        for num_seqs in reversed(self.decode_buckets):
            layers = range(self.num_pieces - 1)
            for i in layers:  # warm-up
                self._decode_attention(i, num_seqs)
            torch.cuda.synchronize(device)
            graphs = [self._capture_one(functools.partial(self._decode_attention, i, num_seqs)) for i in layers]
            self.decode_graphs[num_seqs] = graphs
            self.decode_replays[num_seqs] = [graph.replay for graph in graphs]
        # Largest first, so smaller buckets reuse its memory pool.
        for size in reversed(self.buckets):
            for i in range(self.num_pieces):  # warm-up: compiles kernels, settles allocator state
                self._piece(i, size)
            torch.cuda.synchronize(device)
            graphs = [self._capture_one(functools.partial(self._piece, i, size)) for i in range(self.num_pieces)]
            self.graphs[size] = graphs
            self.replays[size] = [graph.replay for graph in graphs]
        torch.cuda.synchronize(device)
        self.slot_mapping.fill_(-1)  # the timed replays store nothing
        self.bucket.measure(self.replays, "piecewise graphs")

    def use_eager_pieces(self) -> None:
        """Run the pieces uncaptured over the same static buffers (any device): the plumbing without the graphs,
        which is how the CPU tests check it."""
        self.replays = {size: [functools.partial(self._piece, i, size) for i in range(self.num_pieces)]
                        for size in self.buckets}
        self.decode_replays = {n: [functools.partial(self._decode_attention, i, n) for i in range(self.num_pieces - 1)]
                               for n in self.decode_buckets}

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
            meta: AttentionMetadata, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """The forward of a step's `num_tokens` tokens → hidden states [T, hidden] (a view of a static buffer: read
        it before the next step). The inputs are [bucket] host tensors, padded (token 0, position 0, slot -1),
        copied asynchronously into the static buffers; `meta` is the step's (its slot_mapping unused)."""
        size = input_ids.shape[0]
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(positions, non_blocking=True)
        self.slot_mapping[:size].copy_(slot_mapping, non_blocking=True)
        replays = self.replays[size]
        decode_replays = self._stage_decodes(meta)
        model, kv = self.runner.model, self.runner.kv_layers
        q, k, v, out = self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens], self.attn_out[:num_tokens]
        replays[0]()
        for i in range(self.num_pieces - 1):
            if decode_replays is not None:
                decode_replays[i]()  # first: its padding rows' zeros are overwritten by the prompt attention
            model.attend(i, q, k, v, kv, meta, out, with_decode=decode_replays is None)
            if on_layer_done is not None:
                on_layer_done(i)
            replays[i + 1]()
        return self.hidden[:num_tokens]

    def _stage_decodes(self, meta: AttentionMetadata) -> list[Callable[[], object]] | None:
        """The decode tokens' pages into the static buffers, and their attention's replays (None: no decode tokens,
        or more than the graphs hold: `attend` runs theirs)."""
        num_decode = meta.num_decode_tokens
        if not num_decode or not self.decode_buckets or num_decode > self.decode_buckets[-1]:
            return None
        assert meta.block_tables is not None and meta.context_lens is not None
        num_seqs = next(b for b in self.decode_buckets if b >= num_decode)
        self.block_tables[:num_decode, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.context_lens[:num_decode].copy_(meta.context_lens)
        if num_seqs > num_decode:
            self.context_lens[num_decode:num_seqs].zero_()
        return self.decode_replays[num_seqs]

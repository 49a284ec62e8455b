"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over static buffers.

A small model's decode step is dozens of kernel launches per layer; replaying a captured graph
replaces them with one launch. Constraints respected here: the inputs live in static buffers
(block tables sized to the maximum model length), the context-split count is fixed per graph, and
the kernels are warmed up (Triton compiled/autotuned) before capture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.runner import DecodeInputs, ModelRunner

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch_size: int) -> None:
        from tandem.engine.runner import DecodeInputs

        self.runner = runner
        self.buckets = [b for b in BUCKETS if b <= max_batch_size] or [1]
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

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Replay the smallest graph that fits, with `inputs` (pinned host tensors, copied asynchronously
        straight into the static buffers; device tensors work too)."""
        num_seqs = inputs.input_ids.shape[0]
        size = next(b for b in self.buckets if b >= num_seqs)
        s = self.static
        s.input_ids[:num_seqs].copy_(inputs.input_ids, non_blocking=True)
        s.positions[:num_seqs].copy_(inputs.positions, non_blocking=True)
        s.slot_mapping[:num_seqs].copy_(inputs.slot_mapping, non_blocking=True)
        s.slot_mapping[num_seqs:size].fill_(-1)
        s.context_lens[:num_seqs].copy_(inputs.context_lens, non_blocking=True)
        s.context_lens[num_seqs:size].zero_()
        width = inputs.block_tables.shape[1]
        s.block_tables[:num_seqs, :width].copy_(inputs.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]

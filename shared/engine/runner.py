"""The model runner: owns the weights, the KV cache tensors and the CUDA graphs.

`execute(scheduler_output)` turns a batch of requests into flat tensors (packed prefill, or one
token per sequence for decode), runs the forward, and samples one token per request.
"""

from __future__ import annotations

import array
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields

import torch

from tandem.common.config import EngineConfig
from tandem.engine.attention import AttentionMetadata
from tandem.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from tandem.engine.kv_cache import KVCache, as_bytes, kv_cache_dtype, num_blocks_to_allocate
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.request import KVMirror, Request
from tandem.engine.rope import cos_sin_cache
from tandem.engine.sampler import SamplingTensors, sample
from tandem.engine.spec_decode import pad_proposals, verify_proposals
from tandem.engine.staging import HostStaging, staging_enabled
from tandem.engine.step_plan import SchedulerOutput
from tandem.engine.weights import build_model, load_weights
from tandem.kernels import Ops, get_ops, triton_available
from tandem.kernels.cpu_linear import pack_linears
from tandem.kernels.paged_decode_attention import choose_num_splits

# Typecodes of the dtypes a step's inputs use. A flat list of Python numbers converts through `array` ~3.6x faster
# than through torch.tensor, which inspects every element (20,480 ints: 0.50 against 1.84 ms on the 2-core CPU VM;
# a decode step at a batch of 256 and 1,024 tokens of context builds a block table that large every step).
_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}
assert all(array.array(code).itemsize == torch.tensor([], dtype=dtype).element_size()
           for dtype, code in _ARRAY_TYPECODES.items())

log = logging.getLogger(__name__)


def host_tensor(values: list | array.array, dtype: torch.dtype, pin: bool,
                staging: HostStaging | None = None) -> torch.Tensor:
    """A host tensor of a list of numbers (nested lists take torch.tensor's slower path) or of an array of `dtype`'s
    typecode; `pin`: in pinned memory, so that its copy to a GPU is asynchronous; `staging`: that memory from the
    step's arena."""
    code = _ARRAY_TYPECODES.get(dtype)
    if isinstance(values, list) and code is not None and values and not isinstance(values[0], list):
        values = array.array(code, values)
    if isinstance(values, array.array):
        if values.typecode != code:
            raise TypeError(f"an array of typecode {values.typecode!r} for a {dtype} tensor")
        if staging is not None:
            return staging.tensor(values, dtype)
        tensor = torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)
    else:
        tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory() if pin else tensor


def table_row(request: Request) -> bytes:
    """`request.block_ids` as int32 bytes, a row of a block table. Kept on the request and extended as the list
    grows, so that a step joins rows instead of converting every id of every request (a decode step at a batch of
    256 with 1,024-token contexts: 16,384 ids). A list replaced (preemption, a prefix hit, a trim) is encoded anew:
    `block_ids` is never edited in place other than by growing."""
    ids = request.block_ids
    cached = request.table_row
    if cached is not None and cached[0] is ids:
        row = cached[1]
        known = len(row) // 4
        if len(ids) == known:
            return row
        if len(ids) > known:
            row += array.array("i", ids[known:]).tobytes()
            request.table_row = (ids, row)
            return row
    row = array.array("i", ids).tobytes()
    request.table_row = (ids, row)
    return row


def block_table(requests: list[Request]) -> tuple[array.array, int]:
    """The requests' block table [S, width] flat in one int32 array (rows padded with zeros), and its width."""
    width = max(len(r.block_ids) for r in requests)
    padding = bytes(4 * width)
    rows: list[bytes] = []
    for request in requests:
        row = table_row(request)
        rows.append(row)
        rows.append(padding[len(row):])
    table = array.array("i")
    table.frombytes(b"".join(rows))
    return table, width


@dataclass
class DecodeInputs:
    input_ids: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64
    slot_mapping: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32

    def to(self, device: torch.device) -> DecodeInputs:
        """On `device`; asynchronous copies from pinned host tensors."""
        return DecodeInputs(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))


@dataclass
class LaunchedStep:
    """A step whose kernels are queued and whose sampled tokens are on their way to the host (async scheduling: the
    next step may be launched before these are read): a pure decode step, or a prefill worker's step of prompt
    chunks. `pinned`: blocks a decode step writes a slot of, held by the engine until the step is read, so that none
    is handed to anyone while the GPU may still write it."""

    requests: list[Request]
    token_ids: torch.Tensor  # [S] int64, on the device: the next step's input ids
    host_token_ids: torch.Tensor  # [S] int64, on the host once `done`
    host_logprobs: torch.Tensor  # [S] float32
    done: torch.cuda.Event | None  # None on the CPU (the step ran to its end when launched)
    pinned: list[int]

    def result(self, wait: Callable[[Callable[[], bool], Callable[[], None]], None] | None = None
               ) -> tuple[list[list[int]], list[list[float]]]:
        """Waits for the step (not for any launched after it) and returns its tokens as `execute` does. `wait`: how to
        wait, given "is it done?" and "block until it is" (`Engine.wait_for_step`)."""
        if self.done is not None:
            if wait is not None:
                wait(self.done.query, self.done.synchronize)
            self.done.synchronize()  # a no-op once done
        return [[t] for t in self.host_token_ids.tolist()], [[p] for p in self.host_logprobs.tolist()]


# "0": steps with prompt tokens run eagerly (the A/B switch of the benchmarks; also `LLM(piecewise_cuda_graphs=False)`).
PIECEWISE_ENV = "TANDEM_PIECEWISE_GRAPHS"


def slot_mapping(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slot of each position in [start, end) of a sequence whose pages are `block_ids`: a range per block
    rather than a term per token (32 prompts of 256 tokens: 0.58 ms as a comprehension on the 2-core CPU, 0.31
    this way; a prefill worker's step computes them twice with a cuda-ipc mirror)."""
    if end - start == 1:  # a decode token
        return [block_ids[start // block_size] * block_size + start % block_size]
    slots: list[int] = []
    position = start
    while position < end:
        index, offset = divmod(position, block_size)
        first = block_ids[index] * block_size + offset
        run = min(block_size - offset, end - position)
        slots += range(first, first + run)
        position += run
    return slots


def chunk_plan(output: SchedulerOutput) -> tuple[list[tuple[Request, int, int]], list[int], list[Request], list[int]]:
    """A step with prompt tokens: each (request, first position, tokens) to compute; the logits rows each takes (1 +
    its proposals if it samples, else 0); the requests that sample, and their proposals' counts."""
    chunks = [(r, r.num_computed_tokens, n) for r, n in zip(output.requests, output.num_new_tokens, strict=True)]
    samples = [output.samples(i) for i in range(len(chunks))]
    num_spec = [output.num_spec_tokens(i) for i, s in enumerate(samples) if s]
    rows = [1 + output.num_spec_tokens(i) if s else 0 for i, s in enumerate(samples)]
    sampling = [r for r, s in zip(output.requests, samples, strict=True) if s]
    return chunks, rows, sampling, num_spec


def select_ops(config: EngineConfig) -> Ops:
    device = torch.device(config.device)
    return get_ops("triton" if config.use_triton and triton_available(device) else "torch")


class ModelRunner:
    def __init__(self, config: EngineConfig, ops: Ops | None = None, *, extra_kv_bytes_per_block: int = 0,
                 reserved_kv_bytes: int = 0, model: LlamaForCausalLM | None = None) -> None:
        """`extra_kv_bytes_per_block`, `reserved_kv_bytes`: a draft model's pool shares the KV budget
        (`num_blocks_to_allocate`). `model`: the model with its weights already in place (mapped from a peer's,
        `tandem.serving.weight_ipc`), built with `ops`, instead of building and loading one here."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype: torch.dtype = getattr(torch, config.resolved_dtype)
        self.ops = ops or select_ops(config)
        model_config = config.model
        if model is None:
            model = build_model(model_config, self.ops, self.dtype, self.device)
            load_weights(model, model_config)  # quantizes the projections with model_config.quantization
        self.model: LlamaForCausalLM = model
        self.model.eval().requires_grad_(False)
        if self.device.type == "cuda":
            # Quantization replaced the projections: give their unquantized weights back to the GPU, so that the
            # pool's budget counts what this process holds (not what its allocator kept) and peers get the rest.
            torch.cuda.empty_cache()
        if self.device.type == "cpu":
            # oneDNN with prepacked weights: ~4x MKL on decode-sized GEMMs (the fp32 linears left after quantization)
            pack_linears(self.model)
        self.max_model_len = config.max_model_len
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        kv_dtype = kv_cache_dtype(config.cache, self.dtype, self.device)
        num_blocks = num_blocks_to_allocate(model_config, config.cache, kv_dtype, self.device, self.max_model_len,
                                            extra_bytes_per_block=extra_kv_bytes_per_block,
                                            reserved_bytes=reserved_kv_bytes)
        self.kv_cache = KVCache(model_config, self.block_size, num_blocks, kv_dtype, self.device)
        # With how many requests of the whole context fit at once (as vLLM's "maximum concurrency"): a pool squeezed by
        # other workers on the GPU shows here before requests wait for blocks.
        log.info("KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB, %s): %.1f requests of %d tokens at once",
                 num_blocks, self.block_size, num_blocks * self.block_size,
                 self.kv_cache.tensor.numel() * self.kv_cache.tensor.element_size() / (1 << 30), kv_dtype,
                 num_blocks / self.max_blocks_per_seq, self.max_model_len)
        self.model.set_kv_scales(self.kv_cache.scales)
        self.kv_layers = self.kv_cache.layers
        self.cos_sin = cos_sin_cache(model_config.rope, model_config.head_dim, self.max_model_len, self.device)
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 1)
        # A step's inputs go through reused pinned arenas (`step_inputs`).
        self.staging = HostStaging() if self.device.type == "cuda" and staging_enabled() else None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        # The references sync with the host (boolean indexing), which a capture forbids: graphs need Triton.
        if self.device.type == "cuda" and config.use_cuda_graphs and self.ops.name == "triton":
            self.graphs = DecodeGraphs(self, max_batch_size=config.scheduler.max_num_seqs)
            self.graphs.capture()
            if config.piecewise_cuda_graphs and os.environ.get(PIECEWISE_ENV, "1") != "0":
                self.mixed_graphs = PiecewiseGraphs(self, max_tokens=config.budget,
                                                    max_decodes=config.scheduler.max_num_seqs)
                self.mixed_graphs.capture()

    # -- one step ------------------------------------------------------------------------------
    def step_inputs(self) -> AbstractContextManager[None]:
        """Around one step: the host inputs it builds (`_host`) share a pinned arena, reused once their copies have
        run (`HostStaging`)."""
        return self.staging.step() if self.staging is not None else nullcontext()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
                ) -> tuple[list[list[int]], list[list[float]]]:
        """Run one step; return what each request that samples emitted (in order): its new token, or after a
        verify step the accepted proposals and the target's next token; with their logprobs."""
        with self.step_inputs():
            return self._execute(output, on_layer_done)

    def _execute(self, output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
                 ) -> tuple[list[list[int]], list[list[float]]]:
        if output.is_pure_decode:
            sampling = output.requests
            logits = self.decode_logits(output.requests)
            num_spec = [0] * len(sampling)
        else:
            chunks, rows, sampling, num_spec = chunk_plan(output)
            logits = self.chunk_logits(chunks, rows, on_layer_done)
        if not sampling:  # every chunk of the step was a partial prompt
            return [], []
        tensors = SamplingTensors.from_requests(sampling, self.device)
        if any(num_spec):
            proposals = pad_proposals([r.spec_token_ids[:k] for r, k in zip(sampling, num_spec, strict=True)],
                                      max(num_spec), self.device)
            # A draft model's proposals may carry the distribution they were sampled from (rejection sampling).
            draft_probs = [r.spec_draft_probs if k else None for r, k in zip(sampling, num_spec, strict=True)]
            # The one host sync per step: the scheduler needs the tokens to apply stop rules.
            return verify_proposals(logits, proposals, tensors, draft_probs).tolist()
        token_ids, logprobs = sample(logits, tensors)
        return [[t] for t in token_ids.tolist()], [[p] for p in logprobs.tolist()]

    def prefill_logits(self, requests: list[Request],
                       on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [B, V] of the last token of each request, computing all its tokens from position 0."""
        return self.chunk_logits([(r, 0, r.num_tokens) for r in requests], [1] * len(requests), on_layer_done)

    def chunk_logits(self, chunks: list[tuple[Request, int, int]], num_logits: list[int],
                     on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute tokens [start, start + n) of each (request, start, n), packed in one forward (K/V stored into
        the pages as each layer runs); logits [sum(num_logits), V] of the last num_logits[i] tokens of chunk i
        (1: the next token; 1 + k: a verify step's rows; 0: a partial prompt). Decode tokens (first in a step)
        attend through the decode kernel; prompt chunks that all start at position 0 among their own tokens (the
        contiguous prefill kernel), otherwise (later chunks, verify steps) over the paged cache."""
        # The leading decode tokens (the scheduler puts them first) attend through the decode kernel.
        num_decode = 0
        while (num_decode < len(chunks) and chunks[num_decode][2] == 1
               and not chunks[num_decode][0].is_prefilling):
            num_decode += 1
        decodes, prompt_chunks = chunks[:num_decode], chunks[num_decode:]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bounds = [0]  # of every chunk in the packed step, decode tokens included
        for request, start, num_new in chunks:
            # After a preemption the "prompt" is everything so far: recompute rebuilds its KV.
            input_ids += request.token_ids_from(start, num_new)
            positions += range(start, start + num_new)
            slots += self._slots(request, start, start + num_new)
            bounds.append(bounds[-1] + num_new)
        cu_seqlens = [b - num_decode for b in bounds[num_decode:]]
        num_tokens = bounds[-1]
        graphs = self.mixed_graphs if self.mixed_graphs is not None and self.mixed_graphs.can_run(num_tokens) else None
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=graphs.slot_mapping if graphs is not None else self._to_device(slots, torch.int64),
            cu_seqlens=self._to_device(cu_seqlens, torch.int32),
            max_seqlen=max(n for _, _, n in prompt_chunks),
            num_decode_tokens=num_decode,
            kv_mirrors=self._mirror_slots(chunks, bounds),
        )
        if any(start > 0 for _, start, _ in prompt_chunks):
            meta.prefill_block_tables = self._block_tables([r for r, _, _ in prompt_chunks])
            meta.seq_lens = self._to_device([start + n for _, start, n in prompt_chunks], torch.int32)
        if decodes:
            meta.block_tables = self._block_tables([r for r, _, _ in decodes])
            meta.context_lens = self._to_device([start + 1 for _, start, _ in decodes], torch.int32)
            meta.num_splits = self.num_splits_for(num_decode)
        if graphs is not None:
            padding = graphs.bucket(num_tokens) - num_tokens
            hidden = graphs.run(self._host(input_ids + [0] * padding, torch.int64),
                                self._host(positions + [0] * padding, torch.int64),
                                self._host(slots + [-1] * padding, torch.int64), num_tokens, meta, on_layer_done)
        else:
            hidden = self.model(self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                                self.kv_layers, meta, self.cos_sin, on_layer_done)
        last = self._to_device([row for end, count in zip(bounds[1:], num_logits, strict=True)
                                for row in range(end - count, end)], torch.int64)
        return self.model.compute_logits(hidden[last])

    def decode_logits(self, requests: list[Request], after: LaunchedStep | None = None,
                      rows: list[int] | None = None) -> torch.Tensor:
        """Logits [S, V] of a decode step. With `after` (a launched step whose tokens the host has not applied),
        each request's input is the token `after` sampled in row `rows[i]`, taken on the device, at the position
        after its last known token."""
        inputs = self.prepare_decode(requests, lookahead=after is not None)
        input_ids = None
        if after is not None:
            assert rows is not None
            input_ids = after.token_ids.index_select(0, self._to_device(rows, torch.int64))
        if self.graphs is not None and self.graphs.can_run(len(requests)):
            # Copied from the host straight into the graph's static buffers.
            return self.graphs.run(inputs, input_ids)
        inputs = inputs.to(self.device)
        if input_ids is not None:
            inputs.input_ids = input_ids
        return self.forward_decode(inputs, self.num_splits_for(len(requests)))

    @torch.inference_mode()
    def launch_decode(self, requests: list[Request], after: LaunchedStep | None = None,
                      rows: list[int] | None = None) -> LaunchedStep:
        """Queue a pure decode step (see `decode_logits`) and its tokens' copy to the host, without waiting."""
        with self.step_inputs():
            return self._launch_decode(requests, after, rows)

    def _launch_decode(self, requests: list[Request], after: LaunchedStep | None,
                       rows: list[int] | None) -> LaunchedStep:
        logits = self.decode_logits(requests, after, rows)
        token_ids, logprobs = sample(logits, SamplingTensors.from_requests(requests, self.device,
                                                                           num_unapplied=int(after is not None)))
        return self._launched(requests, token_ids, logprobs)

    @torch.inference_mode()
    def launch_chunks(self, output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
                      ) -> LaunchedStep:
        """Queue a step of prompt chunks (prefill role: no decode tokens, no proposals) and its sampled first tokens'
        copy to the host, without waiting; the returned step's `requests` are those whose last chunk this is (the
        rows of its tokens)."""
        with self.step_inputs():
            chunks, rows, sampling, _ = chunk_plan(output)
            logits = self.chunk_logits(chunks, rows, on_layer_done)
            if sampling:
                token_ids, logprobs = sample(logits, SamplingTensors.from_requests(sampling, self.device))
            else:
                token_ids = torch.empty(0, dtype=torch.int64, device=self.device)
                logprobs = torch.empty(0, dtype=torch.float32, device=self.device)
            return self._launched(sampling, token_ids, logprobs)

    def _launched(self, requests: list[Request], token_ids: torch.Tensor, logprobs: torch.Tensor) -> LaunchedStep:
        """A launched step of `requests` whose sampled tokens go to pinned host memory behind an event."""
        if self.device.type != "cuda":
            return LaunchedStep(requests, token_ids, token_ids, logprobs, None, [])
        host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        host_ids.copy_(token_ids, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(requests, token_ids, host_ids, host_logprobs, done, [])

    def prepare_decode(self, requests: list[Request], lookahead: bool = False) -> DecodeInputs:
        """The step's inputs as host tensors (pinned when the model is on a GPU, so that their copies to
        the device are asynchronous). `lookahead`: each request has one more token than it knows (sampled by a
        step not applied yet): it computes that token's position, and its input id is filled in on the device."""
        bs = self.block_size
        input_ids, positions, slots, context_lens = [], [], [], []
        ahead = int(lookahead)
        for request in requests:
            block_ids = request.block_ids
            num_tokens = request.num_tokens + ahead
            position = num_tokens - 1  # the last token's K/V is written this step
            input_ids.append(0 if lookahead else request.last_token_id)
            positions.append(position)
            slots.append(block_ids[position // bs] * bs + position % bs)  # `slot_mapping` of one position
            context_lens.append(num_tokens)
        block_tables, max_blocks = block_table(requests)
        return DecodeInputs(
            input_ids=self._host(input_ids, torch.int64),
            positions=self._host(positions, torch.int64),
            slot_mapping=self._host(slots, torch.int64),
            block_tables=self._host(block_tables, torch.int32).view(len(requests), max_blocks),
            context_lens=self._host(context_lens, torch.int32),
        )

    def forward_decode(self, inputs: DecodeInputs, num_splits: int) -> torch.Tensor:
        """Decode forward → logits [S, V]; also the body that CUDA graphs capture."""
        meta = AttentionMetadata(is_prefill=False, slot_mapping=inputs.slot_mapping,
                                 block_tables=inputs.block_tables, context_lens=inputs.context_lens,
                                 num_splits=num_splits)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_layers, meta, self.cos_sin)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def warm_up_attention(self) -> None:
        """Compile every launch configuration of the attention kernels that eager steps can pick, so that no
        request waits for Triton (on an H200, 0.5-3 s per compile): the contiguous prefill kernel's tile sizes
        (by the longest new sequence), the paged prefill kernel's (by the longest chunk: prompt chunks with
        context, prefix-cache hits, verify steps), the mirrored store (prefill role) and the decode kernel's split
        layouts at every batch size of an eager mixed step (the captured graphs compiled theirs). Inputs are views
        of a fused qkv output, as in the model, so strides and alignment match; the caches are only read."""
        if self.ops.name != "triton":
            return  # the references compile nothing
        attention = next(m for m in self.model.modules() if hasattr(m, "k_scale"))
        k_scale, v_scale = attention.k_scale, attention.v_scale
        cfg = self.config.model
        num_q, num_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        k_cache, v_cache = self.kv_layers[0]
        bs = self.block_size
        scale = head_dim ** -0.5

        def qkv(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            fused = torch.ones(num_tokens, (num_q + 2 * num_kv) * head_dim, device=self.device, dtype=self.dtype)
            q, k, v = fused.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
            return (q.view(num_tokens, num_q, head_dim), k.view(num_tokens, num_kv, head_dim),
                    v.view(num_tokens, num_kv, head_dim))

        def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        lengths = sorted({min(n, self.max_model_len - 1) for n in (1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129)})
        for num_tokens in lengths:
            q, k, v = qkv(num_tokens)
            self.ops.prefill_attention(q, k, v, ints([0, num_tokens]), num_tokens, scale)
            context = min(bs, self.max_model_len - num_tokens)
            seq_len = context + num_tokens
            self.ops.paged_prefill_attention(q, k_cache, v_cache, ints([[0] * -(-seq_len // bs)]),
                                             ints([0, num_tokens]), ints([seq_len]), num_tokens, scale,
                                             k_scale=k_scale, v_scale=v_scale)
        # The prefill role's second store, into a decode worker's pool on this GPU (only a mirrored request launches
        # it: the model's own store is fused with RoPE), with int64 slots as `_mirror_slots` makes them; -1 stores
        # nothing. Left out, the first mirrored request would wait for its compile.
        _, k, v = qkv(bs + 1)
        self.ops.store_kv(k, v, k_cache, v_cache, torch.full((bs + 1,), -1, dtype=torch.int64, device=self.device),
                          k_scale, v_scale)
        layouts: dict[tuple[int, bool], int] = {}
        for num_seqs in range(1, self.config.scheduler.max_num_seqs + 1):
            num_splits = self.num_splits_for(num_seqs)
            layouts.setdefault((1 << (num_splits - 1).bit_length(), num_splits == 1), num_seqs)
        for num_seqs in layouts.values():
            q, _, _ = qkv(num_seqs)
            self.ops.paged_decode_attention(q, k_cache, v_cache, ints([[0]] * num_seqs), ints([1] * num_seqs), scale,
                                            self.num_splits_for(num_seqs), k_scale=k_scale, v_scale=v_scale)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def num_splits_for(self, num_seqs: int) -> int:
        # Fixed by batch size and the maximum length (not the actual contexts) so that a captured
        # graph and an eager step of the same batch size split the same way.
        return choose_num_splits(num_seqs, self.config.model.num_key_value_heads, self.max_model_len,
                                 self.num_sms)

    def _slots(self, request: Request, start: int, end: int, block_ids: list[int] | None = None) -> list[int]:
        return slot_mapping(request.block_ids if block_ids is None else block_ids, start, end, self.block_size)

    def _mirror_slots(self, chunks: list[tuple[Request, int, int]], cu_seqlens: list[int]
                      ) -> list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
        """Per mirrored pool, the slot of each of this step's tokens in it (-1 for tokens going elsewhere, and for
        tokens whose pages the receiver already holds): one more store per layer per pool, built once per step
        (no per-layer host work). Blocks this worker found in its prefix cache that the receiver lacks are
        copied over once, on the request's first step."""
        by_pool: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]] = {}
        bs = self.block_size
        for i, (request, start, num_new) in enumerate(chunks):
            mirror = request.kv_mirror
            if mirror is None:
                continue
            _, slots = by_pool.setdefault(id(mirror.layers), (mirror.layers, [-1] * cu_seqlens[-1]))
            first = max(start, request.num_receiver_cached_tokens)
            if first < start + num_new:
                offset = cu_seqlens[i] + first - start
                slots[offset:cu_seqlens[i + 1]] = self._slots(request, first, start + num_new, mirror.block_ids)
            if start == request.num_cached_tokens > request.num_receiver_cached_tokens:
                self._copy_blocks(request.block_ids, mirror, request.num_receiver_cached_tokens // bs, start // bs)
        return [(layers, self._to_device(slots, torch.int64)) for layers, slots in by_pool.values()]

    def _copy_blocks(self, block_ids: list[int], mirror: KVMirror, first: int, end: int) -> None:
        """Copy this pool's blocks [first, end) of a request into the same positions of its mirror."""
        src = self._to_device(block_ids[first:end], torch.int64)
        dst = self._to_device(mirror.block_ids[first:end], torch.int64)
        for (k_dst, v_dst), (k_src, v_src) in zip(mirror.layers, self.kv_layers, strict=True):
            as_bytes(k_dst).index_copy_(0, dst, as_bytes(k_src).index_select(0, src))
            as_bytes(v_dst).index_copy_(0, dst, as_bytes(v_src).index_select(0, src))

    def _block_tables(self, requests: list[Request]) -> torch.Tensor:
        flat, max_blocks = block_table(requests)
        return self._to_device(flat, torch.int32).view(len(requests), max_blocks)

    def _host(self, values: list | array.array, dtype: torch.dtype) -> torch.Tensor:
        return host_tensor(values, dtype, pin=self.device.type == "cuda", staging=self.staging)

    def _to_device(self, values: list | array.array, dtype: torch.dtype) -> torch.Tensor:
        return self._host(values, dtype).to(self.device, non_blocking=True)

"""Decode attention over a paged KV cache: one query token per sequence, flash-decoding with splits.

Phase 1, grid (S, Hkv, num_splits): each program walks one slice of one sequence's context for one
kv head, loading every KV tile once for all the query heads of its GQA group, and keeps an online
softmax. Phase 2 (only when num_splits > 1), grid (S, Hq): combine the splits' partial results by
their log-sum-exp. Splitting the context keeps the GPU busy when S * Hkv is small (batch 1, long
context), where one program per (sequence, kv head) would leave most SMs idle.

FP8 cache (float8_e4m3fn pages with static scales per kv head, `fp8_kv`): a program's kv head is fixed,
so its K scale folds into the softmax scale and its V scale into the output; the tiles are only
converted to q's dtype (exact) before the dots. Half the bytes of a bf16 cache, which is what a decode
step at a long context streams.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from tandem.kernels._triton import (
    check_last_dim_contiguous,
    check_launchable,
    check_out,
    dot_precision,
    pdl_prologue,
    tl,
    triton,
    use_pdl,
)
from tandem.kernels.fp8_kv import check_kv_cache, dequantize_kv, gather_pages

_LOG2E = 1.4426950408889634
# A split streams at least 64 tokens: a shorter slice would not pay for its partial write and combine.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (sequence, kv head): none once S * Hkv fills two waves of SMs, else enough for
    about four waves, each split at least MIN_TOKENS_PER_SPLIT of max_context.

    Measured on an H200 (Llama-3.1-8B shapes, bf16, CUDA graph replay): batch 1 at 1k context went
    from 24 us (2 splits) to 12 us (16); batch 1 at 16k from 77 us (8) to 34 us (64); at batch 32,
    1 to 4 splits were within 7% of each other. Pure function of shapes, so a CUDA graph captured
    for a batch size fixes it at capture time; with max_context = max_model_len, short contexts
    leave some splits empty, which exit after writing an empty partial.

    The combine launch (review, not yet measured on its own): on an H200 with Llama-3.1-8B (Hkv 8) the
    split path, and so the second kernel, runs up to batch 32 (S * Hkv < 264; 3 splits at 32, 4 at 17).
    There the combine moves little (batch 32: 1.5 MB of fp32 partials written and read back, ~0.7 us)
    and costs mostly its launch, ~2-3 us per layer, ~2% of a step. Two ways to drop it at batch 17-32:
    (a) a one-wave threshold (num_splits 1 once S * Hkv >= num_sms): all 256 programs of batch 32 are
    resident at once with ~8 MB of tiles in flight, more than the ~4 MB that 4.25 TB/s x ~1 us latency
    needs, so uniform contexts should not slow down; a skewed batch would (one long context's 8 programs
    finish alone, with no splits to share them). (b) fold the combine into the split kernel: each split
    writes its partial, then bumps an int32 counter per (sequence, kv head) with an acq_rel atomic; the
    program that sees the count reach num_splits merges the partials and resets the counter to 0, so a
    CUDA graph replays it as is. (b) keeps the splits for skewed batches and removes the launch at every
    batch; its memory ordering cannot be checked in the interpreter. Neither is the default until the
    measurement in the kernel benchmark (batch 17-32, uniform and skewed contexts) says so.
    """
    num_programs = max(num_seqs * num_kv_heads, 1)
    if num_programs >= 2 * num_sms:
        return 1
    wanted = -(-4 * num_sms // num_programs)
    by_length = max(max_context // MIN_TOKENS_PER_SPLIT, 1)
    return max(1, min(wanted, by_length, MAX_SPLITS))


# Not specialised on the split count or the block tables' width (both vary between eager steps and the captured
# graphs): one compiled variant per (BLOCK_SPLITS, IS_SINGLE_SPLIT), which the engine's warm-up compiles.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, lse_ptr, final_ptr, counters_ptr,
    scale_log2, num_splits,
    stride_qs, stride_qh,
    stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    stride_bt,
    stride_os, stride_oh, stride_osplit,
    stride_ls, stride_lh,
    stride_fs, stride_fh,
    num_queries_per_kv,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_SINGLE_SPLIT: tl.constexpr, IS_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    COMBINE_IN_KERNEL: tl.constexpr, BLOCK_SPLITS: tl.constexpr, F16_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if IS_FP8:  # q . (k8 * s_k) = (q . k8) * s_k, and the V scale multiplies the output once
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    else:
        qk_scale = scale_log2
    context_len = tl.load(context_lens_ptr + seq)
    # Slices are whole tiles, so only a slice's last tile is ragged. The context is only known on the
    # device, so each program derives its own slice; a slice past the end is empty (ctx 0 → all are).
    tokens_per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    offs_g = tl.arange(0, BLOCK_G)  # the group's query heads, padded to >= 16 rows for tl.dot
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < num_queries_per_kv
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * num_queries_per_kv + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if F16_DOT:
        # fp8 tiles then convert to fp16 in one instruction (sm_89+), and both dots run in fp16. Each query head's row
        # of q goes in scaled by a power of two (exact) that puts its largest entry in [4, 8), the scale put back on
        # that row's logits: no product with an e4m3 value (<= 448) nor a sum of 16 of them passes fp16's 65504,
        # whatever q's range, and only entries below 2^-14 of their row's largest lose bits (as fp16 subnormals).
        # (A fixed 2^-8 scale gave non-finite output on an H100 for a q of ~1e5, where the interpreter was exact.)
        q32 = q.to(tl.float32)
        amax_bits = tl.max(tl.abs(q32), axis=1).to(tl.int32, bitcast=True)  # [BLOCK_G]
        exponent = tl.minimum(tl.maximum((amax_bits >> 23) & 0xFF, 3), 252)  # biased; 0 (an all-zero row) -> 3
        q = (q32 * ((256 - exponent) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)  # x 2^(2 - E)
        row_scale = ((exponent - 2) << 23).to(tl.float32, bitcast=True)  # 2^(E - 2), per row

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n_start in range(start, end, BLOCK_N):
        n_idx = n_start + offs_n
        n_mask = n_idx < end
        # Gather: token n lives at block_tables[seq, n // PAGE_SIZE], row n % PAGE_SIZE of that page.
        pages = tl.load(block_tables_ptr + seq * stride_bt + n_idx // PAGE_SIZE, mask=n_mask, other=0)
        pages = pages.to(tl.int64)
        rows = n_idx % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = k_cache_ptr + (pages * stride_kc_block + rows * stride_kc_offset)[:, None]
        k = tl.load(k_rows + kv_head * stride_kc_head + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        k = k.to(q.dtype)  # fp8 -> q's dtype is exact; a no-op otherwise
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        if F16_DOT:
            qk = qk * row_scale[:, None]
        # The tile's first token is always in range, so every row max is finite.
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_cache_ptr + (pages * stride_vc_block + rows * stride_vc_offset)[:, None]
        v = tl.load(v_rows + kv_head * stride_vc_head + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = l_i > 0
    # An empty slice (or a ctx-0 padding row) yields zeros, never 0/0.
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    if IS_FP8:
        out = out * v_scale
    out_mask = g_mask[:, None] & d_mask[None, :]
    out_offs = seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
    if IS_SINGLE_SPLIT:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + out_offs + split * stride_osplit, out, mask=out_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g_mask)
        if COMBINE_IN_KERNEL:
            # The last of the (sequence, kv head)'s splits to finish merges them all (no second launch). Every
            # thread's stores above are done (barrier) before one gpu-scope release: the add that counts this
            # split; the program that counts last acquires them (the same add), merges, and rearms the counter
            # for the next launch (a CUDA graph replays it as captured). Partials are read past L1 (.cg).
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.store(counter, 0)
                for g in range(num_queries_per_kv):
                    _combine_head(out_ptr, lse_ptr, final_ptr, seq, kv_head * num_queries_per_kv + g,
                                  num_splits, HEAD_DIM, stride_os, stride_oh, stride_osplit, stride_ls, stride_lh,
                                  stride_fs, stride_fh, BLOCK_SPLITS, BLOCK_D, ".cg")


@triton.jit
def _combine_head(
    partial_ptr, lse_ptr, out_ptr, seq, head,
    num_splits, head_dim,
    stride_ps, stride_ph, stride_psplit,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr,
):
    """One query head's output: each split's normalised output weighted by its share of the total exp-sum."""
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"),
                  cache_modifier=CACHE)
    lse_max = tl.max(lse, axis=0)
    # All splits empty (ctx 0): weights become 0 and the output 0, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [BLOCK_SPLITS]
    total = tl.sum(weights, axis=0)
    partial = tl.load(partial_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_psplit
                      + offs_d[None, :], mask=s_mask[:, None] & (offs_d < head_dim)[None, :], other=0.0,
                      cache_modifier=CACHE)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


@triton.jit
def _combine_splits_kernel(
    partial_ptr, lse_ptr, out_ptr,
    num_splits, head_dim,
    stride_ps, stride_ph, stride_psplit,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # wait for the previous grid before any global access (see _triton)
    # Grid (S, Hq).
    _combine_head(partial_ptr, lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1),
                  num_splits, head_dim, stride_ps, stride_ph, stride_psplit, stride_ls, stride_lh,
                  stride_os, stride_oh, BLOCK_SPLITS, BLOCK_D, "")


# Arrival counters of the in-kernel combine, one int32 per (sequence, kv head), per device: zero between launches
# (each launch's last split rearms its own). Grown only outside a CUDA-graph capture; an outgrown buffer is kept,
# since a captured graph may still point at it. Launches on one device must not overlap in time (one stream).
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _split_counters(device: torch.device, size: int) -> torch.Tensor | None:
    """At least `size` zeroed counters on `device`; None under a capture that would need new ones."""
    counters = _COUNTERS.get(device)
    if counters is not None and counters.numel() >= size:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if counters is not None:
        _OUTGROWN.append(counters)
    counters = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    _COUNTERS[device] = counters
    return counters


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Validate the arguments; whether the cache is fp8."""
    num_seqs, num_q_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"paged_decode_attention: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
                         f"must be [N, B, Hkv, {head_dim}]")
    if num_q_heads % k_cache.shape[2]:
        raise ValueError(f"paged_decode_attention: {num_q_heads} query heads not a multiple of "
                         f"{k_cache.shape[2]} kv heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"paged_decode_attention: block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must be [{num_seqs}, max_blocks] and [{num_seqs}]")
    # No dtype match with q asked of a non-fp8 cache: the op never required one.
    return check_kv_cache("paged_decode_attention", k_cache, v_cache, k_scale, v_scale, None, "q")


class DecodeAttentionConfig(NamedTuple):
    """Launch settings of the split kernel: KV tokens per tile, warps, pipeline stages, and whether an fp8 cache's
    tiles are multiplied in fp16 (`f16_dot`; only with a bf16 / fp16 q, else ignored)."""

    block_n: int
    num_warps: int
    num_stages: int
    f16_dot: bool = False

    @classmethod
    def parse(cls, text: str) -> DecodeAttentionConfig:
        """"BLOCK_N,WARPS,STAGES[,f16]" (the form of $TANDEM_FP8_KV_DECODE_TILE)."""
        parts = [p.strip() for p in text.split(",")]
        try:
            if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ("f16", "bf16")):
                raise ValueError
            block_n, num_warps, num_stages = (int(p) for p in parts[:3])
        except ValueError:
            raise ValueError(f"${FP8_TILE_ENV}={text!r}: expected BLOCK_N,WARPS,STAGES[,f16|bf16]") from None
        if block_n not in (16, 32, 64, 128, 256) or num_warps not in (1, 2, 4, 8) or not 1 <= num_stages <= 6:
            raise ValueError(f"${FP8_TILE_ENV}={text!r}: BLOCK_N in 16..256 (a power of 2), WARPS 1/2/4/8, STAGES 1..6")
        return cls(block_n, num_warps, num_stages, len(parts) == 4 and parts[3] == "f16")


FP8_TILE_ENV = "TANDEM_FP8_KV_DECODE_TILE"  # an fp8 cache's tile, "BLOCK_N,WARPS,STAGES[,f16]", for A/B runs


@functools.cache
def _fp8_tile_override() -> DecodeAttentionConfig | None:
    text = os.environ.get(FP8_TILE_ENV, "").strip()
    return DecodeAttentionConfig.parse(text) if text else None


def decode_attention_config(head_dim: int, is_fp8: bool, num_splits: int = 1) -> DecodeAttentionConfig:
    """The split kernel's launch settings for a head size, cache dtype and split count.

    bf16, swept on an H200 (Triton 3.6, block_size 16, Llama GQA 32/8): 4 warps, 2 stages; 64-token tiles at D 128
    (98% of copy bandwidth at batch 256), 128-token tiles at D 64 (small tiles left D 64 latency-bound at batch 64).
    An fp8 cache's tile holds half the bytes: without splits (S * Hkv past two waves of SMs, batch >= 33 for Llama 8B
    on an H100) it takes twice the tokens: 18-25% less time than the bf16 tile at batch 64, 3-4% at batch 256 on an
    H100 (`benchmarks/decode_attention_sweep.py`, `benchmarks/results/README.md`); with splits (small batches) the
    bf16 tile stays, as slices are whole tiles. At D 128 the fp8 tile also multiplies in fp16 with 3 stages
    (`128,4,3,f16`): 24-38% less time than the bf16 tile at batch 64-256 in the sweep, and through the 8B decode step
    8.11 -> 7.46 ms at batch 64 and 17.07 -> 14.55 ms at batch 256 against `128,4,2` (H100, 2026-12-07, eighth
    session; its GPU tests pass with q scaled per row). $TANDEM_FP8_KV_DECODE_TILE (read once per process) overrides
    an fp8 cache's tile (`...,bf16` turns the fp16 dots off).
    """
    if is_fp8 and (override := _fp8_tile_override()) is not None:
        return override
    if head_dim <= 64:
        return DecodeAttentionConfig(128, 4, 2)
    if is_fp8 and num_splits == 1 and head_dim <= 128:
        return DecodeAttentionConfig(128, 4, 3, True)
    block_n = 64 if head_dim <= 128 else 32
    if is_fp8 and num_splits == 1:
        block_n *= 2
    return DecodeAttentionConfig(block_n, 4, 2)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None, combine_in_kernel: bool = False,
                                  out: torch.Tensor | None = None,
                                  config: DecodeAttentionConfig | None = None) -> torch.Tensor:
    """q [S, Hq, D], k_cache, v_cache [N, B, Hkv, D], block_tables [S, max_blocks] int32,
    context_lens [S] int32 -> [S, Hq, D] (into `out` where given: a view of q's shape and dtype, unit last stride).

    Sequence s attends to its first context_lens[s] cached tokens; block_tables[s, j] is the physical
    block of its logical block j. A row with context_lens 0 gives zeros. num_splits=None picks
    `choose_num_splits` with max_blocks * B as the context bound; pass an int to fix it (CUDA graphs).
    A float8_e4m3fn cache needs k_scale, v_scale [Hkv] float32 (a cached value reads as e4m3 * scale);
    converting fp8 tiles needs sm_89 or newer on CUDA.
    combine_in_kernel: with splits, the last split of each (sequence, kv head) merges them (one launch, not two;
    the same arithmetic as the combine kernel); not yet measured nor run on GPU, so off unless asked for (the
    `attn_combine` fusion of `tandem.kernels.ops`). Under a CUDA-graph capture that would need more arrival
    counters than exist, the two launches.
    config: the launch settings (default `decode_attention_config`); its f16_dot applies to an fp8 cache read with a
    bf16 / fp16 q only (fp16 holds every e4m3 value, and a bf16 q's values within fp16's range, exactly).
    """
    check_launchable("paged_decode_attention", q, k_cache, v_cache, block_tables, context_lens)
    check_last_dim_contiguous("paged_decode_attention", q=q, k_cache=k_cache, v_cache=v_cache,
                              block_tables=block_tables)
    is_fp8 = _check_shapes(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else check_out("paged_decode_attention", out, q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * page_size,
                                       _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    num_queries_per_kv = num_q_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block_g = max(triton.next_power_of_2(num_queries_per_kv), 16)
    if block_d > 256 or block_g > 64:
        raise ValueError(f"paged_decode_attention: head_dim {head_dim} (<= 256) or GQA group "
                         f"{num_queries_per_kv} (<= 64) unsupported")
    cfg = config if config is not None else decode_attention_config(head_dim, is_fp8, num_splits)
    f16_dot = cfg.f16_dot and is_fp8 and q.dtype in (torch.bfloat16, torch.float16)
    is_single_split = num_splits == 1
    if is_single_split:
        partial, lse = out, out  # the kernel writes the final output directly; lse is unused
        partial_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        # Scratch, from the caching allocator (a graph's private pool under capture): no host sync.
        partial = q.new_empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32)
        lse = q.new_empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32)
        partial_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    counters = None
    if combine_in_kernel and not is_single_split:
        counters = _split_counters(q.device, num_seqs * num_kv_heads)
    pdl = use_pdl(q.device)
    _paged_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        k_scale if is_fp8 else context_lens, v_scale if is_fp8 else context_lens,  # unread unless fp8
        partial, lse, out, context_lens if counters is None else counters,  # counters unread without them
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *partial_strides, *lse_strides, out.stride(0), out.stride(1),
        num_queries_per_kv,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_G=block_g, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        IS_SINGLE_SPLIT=is_single_split, IS_FP8=is_fp8, DOT_PRECISION=dot_precision(q.dtype),
        COMBINE_IN_KERNEL=counters is not None,
        BLOCK_SPLITS=1 if counters is None else triton.next_power_of_2(num_splits), F16_DOT=f16_dot,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not is_single_split and counters is None:
        _combine_splits_kernel[(num_seqs, num_q_heads)](
            partial, lse, out, num_splits, head_dim,
            *partial_strides, *lse_strides, out.stride(0), out.stride(1),
            BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=block_d, USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
        )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """Same contract as the Triton version (num_splits is ignored), vectorised over the batch.

    Gathers every sequence's pages padded to the longest context (`index_select`, ~3x faster on the CPU
    than advanced indexing), then PyTorch's fused attention in fp32 with the padding masked: this is the
    engine's decode attention on the CPU, so it is kept lean.
    """
    is_fp8 = _check_shapes(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    given = out
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    max_context = int(context_lens.max()) if num_seqs else 0  # host sync: fine for the reference
    if max_context == 0:
        return torch.zeros_like(q) if out is None else check_out("paged_decode_attention", out, q).zero_()
    num_blocks = -(-max_context // page_size)
    # Entries past a sequence's context may be garbage (e.g. -1); clamp them, the mask hides them.
    pages = block_tables[:, :num_blocks].long().clamp(min=0).flatten()  # [S * nb]
    shape = (num_seqs, num_blocks * page_size, num_kv_heads, head_dim)
    k = gather_pages(k_cache, pages).view(shape)[:, :max_context]  # [S, L, Hkv, D]
    v = gather_pages(v_cache, pages).view(shape)[:, :max_context]
    if is_fp8:
        assert k_scale is not None and v_scale is not None
        k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
    k, v = k.float(), v.float()
    is_valid = torch.arange(max_context, device=q.device) < context_lens[:, None]  # [S, L]
    # A ctx-0 row (CUDA-graph padding) would be all masked, which softmax turns into NaN: let it see one
    # position, and zero its output below, as the kernel does.
    is_empty = context_lens == 0
    is_valid[:, 0] |= is_empty
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),  # [S, H, 1, D], [S, Hkv, L, D]
        attn_mask=is_valid[:, None, None, :], scale=scale, enable_gqa=True).squeeze(2)  # [S, Hq, D]
    out.masked_fill_(is_empty[:, None, None], 0.0)
    if given is not None:
        return check_out("paged_decode_attention", given, q).copy_(out)
    return out.to(q.dtype)

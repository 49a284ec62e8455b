"""Causal attention of new tokens over a paged KV cache: prompt chunks, prefix-cache suffixes, spec tokens.

Sequence s brings q_len_s = cu_seqlens_q[s+1] - cu_seqlens_q[s] new queries and has seq_lens[s] tokens in
all, the new ones last (their K/V are already in the cache: `store_kv` runs first). Query i of it sits at
position p = seq_lens[s] - q_len_s + i and attends to the cached keys 0..p, read through block_tables[s].
Context 0 is a plain prefill, q_len 1 a decode step, 1 + K a speculative verify.

One program per (sequence, kv head, block of BLOCK_Q queries). Its BLOCK_M = BLOCK_Q * G rows are the
queries x the G query heads of one kv head (row r: query r // G, head r % G, so a non-power-of-two group
like 3 leaves BLOCK_M % G rows idle), so every KV tile is loaded once for the whole group. Flash-attention
online softmax in base 2 over key tiles of BLOCK_N tokens gathered page by page; the tiles that every
query of the block sees whole run without a mask, and only the few from the block's first query on (the
diagonal) pay for the causal mask. Query blocks are aligned to the END of each sequence's queries, so
block 0 of every sequence is its heaviest (it sees all seq_len keys) and is launched first, the lighter
early blocks fill the tail.

Cost, for a later benchmark. With ctx_s = seq_lens[s] - q_len_s and e the element size:
  FLOPs  = 4 * Hq * D * sum_s (q_len_s * ctx_s + q_len_s * (q_len_s + 1) / 2)   (QK^T and PV, 2 per MAC;
           the exp2s are not counted)
  bytes >= e * (2 * T * Hq * D  +  2 * Hkv * D * sum_s seq_lens[s])            (q read and out written
           once, each sequence's K and V read once; block tables negligible)
In bf16 that is G * q_len FLOP per byte of KV with a long context (G * q_len / 2 with none), G = Hq / Hkv.
The H200's balance point is ~185 FLOP/byte (790 TFLOP/s bf16 matmul, 4.3 TB/s copy, both measured), so a
prompt chunk (G * q_len in the thousands) is compute-bound: report FLOPs against the matmul rate; a decode
or spec step (G * q_len ~ 4-32) is bound by the KV bytes: report those against the copy bandwidth. Measured
(Triton 3.6, bf16, GQA 32/8, D 128, pages of 16): 339 TFLOP/s on a 4096 prefill (prefill_attention on the
same, contiguous: 359 us against 405), 355 TFLOP/s on 2048 new tokens over 8192 cached, 3.7 TB/s on 64
sequences x 4 spec tokens over 2048 cached. The kernel re-reads a sequence's K/V once per query block,
mostly from L2; one program per (sequence, kv head) at q_len 1 leaves a small batch short of parallelism,
where paged_decode_attention's split-KV does better (8 x 4096 context, D 128: 83 us here, 51 us there in
one run, 85 in another).

FP8 cache (float8_e4m3fn pages with static scales per kv head, `fp8_kv`): a program's kv head is fixed, so
its K scale folds into the softmax scale and its V scale into the output; tiles are converted to q's dtype
(exact) before the 16-bit dots, so the FLOPs above are unchanged and the KV bytes halve.
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import check_last_dim_contiguous, check_launchable, check_out, dot_precision, tl, triton
from tandem.kernels.fp8_kv import check_kv_cache, dequantize_kv, gather_pages

_LOG2E = 1.4426950408889634
_MAX_GRID_Z = 65535  # CUDA's limit on the grid's third dimension (the query blocks)


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_ptr,
                  stride_kc_block, stride_kc_offset, stride_vc_block, stride_vc_offset,
                  q_pos, lo, hi, scale_log2,
                  IS_DIAGONAL: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the cached keys [lo, hi) of one sequence into the online softmax of a block of rows (base 2).
    K/V tiles are converted to q's dtype (fp8 -> 16 or 32 bits is exact); scale_log2 carries the K scale.

    Off the diagonal every key precedes every row's query and lies inside the sequence: no mask. On it,
    row r sees key n iff n <= q_pos[r] (q_pos < hi, so this also drops the tile's keys past hi).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = (offs_d < HEAD_DIM)[None, :]
    for n_start in range(lo, hi, BLOCK_N):
        n_idx = n_start + offs_n
        # Gather: token n lives at block_tables[seq, n // PAGE_SIZE], row n % PAGE_SIZE of that page.
        if IS_DIAGONAL:
            n_mask = n_idx < hi
            pages = tl.load(block_table_ptr + n_idx // PAGE_SIZE, mask=n_mask, other=0)
            kv_mask = n_mask[:, None] & d_mask
        else:
            pages = tl.load(block_table_ptr + n_idx // PAGE_SIZE)
            kv_mask = d_mask
        pages = pages.to(tl.int64)
        rows = n_idx % PAGE_SIZE
        k_rows = k_head_ptr + (pages * stride_kc_block + rows * stride_kc_offset)[:, None]
        k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if IS_DIAGONAL:
            # Every row has seen a key before its first masked tile (key 0 at the latest), so its max is
            # finite and no 0/0 or inf - inf appears.
            qk = tl.where(n_idx[None, :] <= q_pos[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_head_ptr + (pages * stride_vc_block + rows * stride_vc_offset)[:, None]
        v = tl.load(v_rows + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Not specialised on the block tables' width (the longest sequence's blocks, different every step): one compiled
# variant per launch configuration, which the engine's warm-up compiles before serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, scale_log2,
    stride_qt, stride_qh,
    stride_kc_block, stride_kc_offset, stride_kc_head,
    stride_vc_block, stride_vc_offset, stride_vc_head,
    stride_bt,
    stride_ot, stride_oh,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid (S, Hkv, query blocks of the longest q_len); CUDA starts the lowest block ids first, so the
    # query-block index is the slowest-moving one: every sequence's heaviest (last) block goes first.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)  # counted from the end of the sequence's queries
    # Positions and lengths stay int32 (a sequence is < 2^31 tokens); addresses are formed in int64.
    q_seq_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_seq_start
    q_end = q_len - q_block * BLOCK_Q  # this block's queries: [q_end - BLOCK_Q, q_end), clipped at 0
    if q_end <= 0:  # this sequence has fewer query blocks than the longest (or no new tokens)
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_end - BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # query index within the sequence
    heads = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx >= 0)
    io_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens = q_seq_start.to(tl.int64) + q_idx  # rows of q and out
    q_offs = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    # Absolute positions; idle rows act as the block's last query (they see keys, never NaN, never stored).
    last_pos = context_len + q_end - 1
    q_pos = tl.where(row_valid, context_len + q_idx, last_pos)
    first_pos = context_len + tl.maximum(q_end - BLOCK_Q, 0)
    # Whole tiles whose every key is <= first_pos are visible to all rows; the rest up to last_pos is masked.
    diagonal_start = (first_pos + 1) // BLOCK_N * BLOCK_N

    if IS_FP8:  # q . (k8 * s_k) = (q . k8) * s_k; the V scale multiplies the output once, below
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    k_head_ptr = k_cache_ptr + kv_head * stride_kc_head
    v_head_ptr = v_cache_ptr + kv_head * stride_vc_head
    block_table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_ptr,
                                  stride_kc_block, stride_kc_offset, stride_vc_block, stride_vc_offset,
                                  q_pos, 0, diagonal_start, scale_log2,
                                  False, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_ptr,
                                  stride_kc_block, stride_kc_offset, stride_vc_block, stride_vc_offset,
                                  q_pos, diagonal_start, last_pos + 1, scale_log2,
                                  True, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION)

    out = acc / l_i[:, None]
    if IS_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    out_offs = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> bool:
    """Validate the arguments, naming the bad one; whether the cache is fp8."""
    op = "paged_prefill_attention"
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [T, Hq, D], got {tuple(q.shape)}")
    num_q_heads, head_dim = q.shape[1:]
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} must be [N, B, Hkv, {head_dim}]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    is_fp8 = check_kv_cache(op, k_cache, v_cache, k_scale, v_scale, q.dtype, "q")
    page_size, num_kv_heads = k_cache.shape[1:3]
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"{op}: k_cache block size {page_size} must be a power of two")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: q's {num_q_heads} query heads not a multiple of k_cache's "
                         f"{num_kv_heads} kv heads")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"{op}: cu_seqlens_q must be [S+1] with S >= 1, got {tuple(cu_seqlens_q.shape)}")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"{op}: seq_lens {tuple(seq_lens.shape)} must be [{num_seqs}] (cu_seqlens_q is "
                         f"[{num_seqs + 1}])")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"{op}: block_tables {tuple(block_tables.shape)} must be [{num_seqs}, max_blocks]")
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{op}: {name} must hold integers (int32), got {t.dtype}")
    return is_fp8


def _launch_config(dtype: torch.dtype, head_dim: int, max_seqlen_q: int, num_queries_per_kv: int
                   ) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys per tile, num_warps, num_stages).

    Rows are queries x the GQA group, so BLOCK_M covers BLOCK_M // G queries; it shrinks (to 16, tl.dot's
    least) when the step has few queries, so a decode or spec step does not pay for 128 mostly idle rows.

    16-bit, swept on an H200 (Triton 3.6, bf16, block_size 16, GQA 32/8, D 64 and 128; 1 x 4096 prefill,
    2048 new on 8192 cached, 4 x 1024 on 1024, 64 x (1 or 4) on 2048, 8 x 1 on 4096):
    - under 64 rows (decode, spec, short suffixes) the step streams the KV: 128-key tiles, 4 warps,
      2 stages were best or within 2% (spec 64 x 4 at D 128: 146 us, 3.7 TB/s, against 182 us with
      64-key tiles). At D > 128 a K and a V tile of 128 x 256 per stage would not fit twice in shared
      memory: 64-key tiles.
    - D <= 64: 128 x 64 tiles, 8 warps, 3 stages, best on all three prefill shapes (308-338 TFLOP/s).
    - D <= 128: 128 x 32 tiles with 4 warps and 3 stages, best or within 3% (319-355 TFLOP/s); 128 x 64
      with 8 warps (prefill_attention's choice) was 3-13% slower here, the gathered K/V rows costing
      registers that the contiguous kernel does not spend. At 64 rows, 64 x 64 tiles with 4 warps.
    - D > 128 (swept at D 256, GQA 16/4): 128 x 64 tiles, 8 warps, 2 stages, 355-402 TFLOP/s, 17-43%
      ahead of 32-key tiles; the fp32 accumulator of 128 x 256 needs the 8 warps (4 ran 3x slower) and
      3 stages would pass the 228 KB of shared memory. At 64 rows, 64 x 32 tiles with 4 warps came next.
    fp32 (tests and debugging; "ieee" dots run on the FMA units): 64 x 32 tiles, 4 warps, 2 stages keep
    the 4-byte tiles inside shared memory at any head_dim.
    """
    is_16bit = dtype in (torch.float16, torch.bfloat16)
    max_rows = 128 if is_16bit else 64
    block_m = max(16, triton.next_power_of_2(num_queries_per_kv))  # at least one query of the group
    block_m = max(block_m, min(max_rows, triton.next_power_of_2(max_seqlen_q * num_queries_per_kv)))
    if not is_16bit:
        return block_m, 32, 4, 2
    if block_m < 64:
        return block_m, (128 if head_dim <= 128 else 64), 4, 2
    if head_dim <= 64:
        return block_m, 64, (8 if block_m >= 128 else 4), 3
    if head_dim <= 128:
        return block_m, (32 if block_m >= 128 else 64), 4, 3
    return (block_m, 64, 8, 2) if block_m >= 128 else (block_m, 32, 4, 2)


def paged_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   seq_lens: torch.Tensor, max_seqlen_q: int, scale: float,
                                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k_cache, v_cache [N, B, Hkv, D], block_tables [S, max_blocks] int32, cu_seqlens_q
    [S+1] int32, seq_lens [S] int32 -> out [T, Hq, D] (q's dtype; into `out` where given, a [T, Hq, D] view with
    unit last stride, else a new contiguous tensor).

    Sequence s's queries are q[cu_seqlens_q[s]:cu_seqlens_q[s+1]], its last new tokens; seq_lens[s] counts
    its whole length (context + new). max_seqlen_q must be at least the longest q_len (it sizes the grid,
    so no host sync). A sequence with no new tokens is skipped; rows of q past cu_seqlens_q[-1] are left
    unwritten. Query head h reads kv head h // (Hq // Hkv). q may be a strided view (unit last stride).
    The caches hold q's dtype, or float8_e4m3fn with k_scale, v_scale [Hkv] float32 (a cached value reads
    as e4m3 * scale; on CUDA, sm_89 or newer).
    """
    op = "paged_prefill_attention"
    check_launchable(op, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    check_last_dim_contiguous(op, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                              cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    is_fp8 = _check_shapes(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = q.new_empty(q.shape) if out is None else check_out(op, out, q)
    if num_tokens == 0 or max_seqlen_q <= 0:
        return out
    num_queries_per_kv = num_q_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    if block_d > 256 or num_queries_per_kv > 128:
        raise ValueError(f"{op}: head_dim {head_dim} (<= 256) or GQA group {num_queries_per_kv} (<= 128) "
                         f"unsupported")
    block_m, block_n, num_warps, num_stages = _launch_config(q.dtype, head_dim, max_seqlen_q,
                                                             num_queries_per_kv)
    block_q = block_m // num_queries_per_kv
    num_q_blocks = triton.cdiv(max_seqlen_q, block_q)
    if num_q_blocks > _MAX_GRID_Z:
        raise ValueError(f"{op}: max_seqlen_q {max_seqlen_q} needs {num_q_blocks} query blocks of {block_q}, "
                         f"more than the grid allows ({_MAX_GRID_Z})")
    num_seqs = cu_seqlens_q.shape[0] - 1
    _paged_prefill_attention_kernel[(num_seqs, num_kv_heads, num_q_blocks)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
        k_scale if is_fp8 else seq_lens, v_scale if is_fp8 else seq_lens,  # unread unless fp8
        out, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IS_FP8=is_fp8, DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, max_seqlen_q: int, scale: float,
                                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as the Triton version (max_seqlen_q unused), one sequence at a time: gather its
    pages into a contiguous [L, Hkv, D] context (dequantized, for an fp8 cache), then masked softmax
    attention in float32."""
    is_fp8 = _check_shapes(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale)
    page_size = k_cache.shape[1]
    out = q.new_empty(q.shape) if out is None else check_out("paged_prefill_attention", out, q)
    bounds, lens = cu_seqlens_q.tolist(), seq_lens.tolist()  # host sync: fine for the reference
    for s, (start, end, seq_len) in enumerate(zip(bounds[:-1], bounds[1:], lens, strict=True)):
        q_len = end - start
        if q_len == 0:
            continue
        if not 0 < q_len <= seq_len:
            raise ValueError(f"paged_prefill_attention: sequence {s} has {q_len} new tokens but seq_lens "
                             f"{seq_len}")
        # Only the sequence's own pages: table entries past them may be garbage.
        pages = block_tables[s, : -(-seq_len // page_size)].long()
        k = gather_pages(k_cache, pages).flatten(0, 1)[:seq_len]  # [L, Hkv, D]
        v = gather_pages(v_cache, pages).flatten(0, 1)[:seq_len]
        if is_fp8:
            assert k_scale is not None and v_scale is not None
            k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
        k, v = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, L, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # the new tokens' positions
        is_visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, L]
        # enable_gqa maps query head h to kv head h // (Hq // Hkv).
        out_s = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].float().transpose(0, 1), k, v, attn_mask=is_visible, scale=scale, enable_gqa=True)
        out[start:end] = out_s.transpose(0, 1).to(q.dtype)
    return out

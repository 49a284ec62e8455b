"""The paged KV cache: one device tensor, addressed by block id (the block pool hands the ids out).

With `kv_cache_dtype="fp8"` the pages hold float8_e4m3fn (half of bf16's bytes, so twice the blocks in the same
memory) and a float32 tensor of scales [num_layers, 2, Hkv] lives beside them: row 0 of a layer scales its K
heads, row 1 its V heads (`tandem.kernels.fp8_kv`: a value x of head h is stored as e4m3(x / scale[h])). The
scales are static and 1.0, vLLM's default for a checkpoint without calibrated k_scale/v_scale: Llama-family K
and V stay well inside e4m3's +-448, and one fixed value needs no agreement between workers. Pages move between
workers as their fp8 bytes, so a prefill and a decode worker must use the same scales; a calibration pass
(`fp8_kv.kv_absmax`, `kv_scales_from_absmax`) would have to put its scales into the KV layout's fingerprint too.
"""

from __future__ import annotations

import torch

from tandem.common.config import CacheConfig, ConfigError, KVLayout, ModelConfig
from tandem.kernels.fp8_kv import FP8_KV_DTYPE, gather_pages


def as_bytes(pages: torch.Tensor) -> torch.Tensor:
    """fp8 pages viewed as uint8 (same bytes) for gathers and copies, which torch does not implement for float8 on
    every device; other dtypes unchanged."""
    return pages.view(torch.uint8) if pages.dtype == FP8_KV_DTYPE else pages


def kv_cache_dtype(cache: CacheConfig, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the pages: the model's, or float8_e4m3fn for kv_cache_dtype "fp8" (which the attention
    kernels read on CUDA only from compute capability 8.9 on: Ada, Hopper)."""
    if cache.kv_cache_dtype == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"kv_cache_dtype: fp8 pages need compute capability >= 8.9, {device} has "
                          f"{torch.cuda.get_device_capability(device)}")
    return FP8_KV_DTYPE


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * itemsize


def num_blocks_to_allocate(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                           device: torch.device, max_model_len: int, *, extra_bytes_per_block: int = 0,
                           reserved_bytes: int = 0) -> int:
    """Explicit size, else what the memory budget holds for pages of `dtype`; at least one maximal request must
    fit. A second pool sized block for block with this one (a draft model's, `tandem.engine.draft`) shares the
    budget: it takes `extra_bytes_per_block` more per block, and `reserved_bytes` are still to be allocated out of
    the same budget (its extra blocks; on a GPU also the draft's weights)."""
    per_block = bytes_per_block(model, cache.block_size, dtype) + extra_bytes_per_block
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # The fraction caps this process's use of the GPU (weights, activations, KV), so several workers
        # can share one device by each taking its own share; what others hold is respected through
        # `free`, less a margin for CUDA graphs and the allocator.
        used_here = torch.cuda.memory_reserved(device)
        budget = min(int(total * cache.gpu_memory_fraction) - used_here, free - (2 << 30)) - reserved_bytes
        num_blocks = max(budget, 0) // per_block
    else:
        num_blocks = max(cache.cpu_kv_bytes - reserved_bytes, 0) // per_block
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"num_blocks: the KV pool holds {num_blocks} blocks of {cache.block_size} tokens but one "
            f"request of max_model_len={max_model_len} tokens needs {needed}; raise the KV memory or "
            f"lower max_model_len")
    return num_blocks


# Past this many runs of consecutive block ids a write takes one indexed put instead of a copy per run.
MAX_SLICED_RUNS = 4


def _consecutive_runs(block_ids: list[int], limit: int | None = None) -> list[tuple[int, int, int]] | None:
    """(first block id, index into `block_ids`, length) of each run of consecutive ids, in order; None past `limit`
    runs (when given). Called per layer of every page message on decode's engine thread: one run (the usual case)
    is found by a single list comparison, and a scattered list stops being walked at `limit`."""
    if not block_ids:
        return []
    first = block_ids[0]
    if block_ids == list(range(first, first + len(block_ids))):
        return [(first, 0, len(block_ids))]
    runs: list[tuple[int, int, int]] = []
    for i, block_id in enumerate(block_ids):
        if runs and block_id == runs[-1][0] + runs[-1][2]:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        elif len(runs) == limit:
            return None
        else:
            runs.append((block_id, i, 1))
    return runs


class KVCache:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] on one device, in `dtype` (the model's, or
    float8_e4m3fn with `scales` [num_layers, 2, num_kv_heads] float32 beside it)."""

    def __init__(self, model: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.tensor = torch.zeros(model.num_hidden_layers, 2, num_blocks, block_size,
                                  model.num_key_value_heads, model.head_dim, dtype=dtype, device=device)
        self.scales: torch.Tensor | None = None
        if dtype == FP8_KV_DTYPE:
            self.scales = torch.ones(model.num_hidden_layers, 2, model.num_key_value_heads, dtype=torch.float32,
                                     device=device)
        self.layout = KVLayout(dtype=str(dtype).removeprefix("torch."), block_size=block_size,
                               num_layers=model.num_hidden_layers, num_kv_heads=model.num_key_value_heads,
                               head_dim=model.head_dim, model_fingerprint=model.fingerprint())

    @property
    def is_fp8(self) -> bool:
        return self.scales is not None

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]: views, no copies."""
        return [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(self.tensor.shape[0])]

    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's K and V pages, each [len(block_ids), block_size, Hkv, D], in the cache's dtype."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return gather_pages(self.tensor[layer, 0], index), gather_pages(self.tensor[layer, 1], index)

    def write_blocks(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write pages (each [len(block_ids), block_size, Hkv, D]) into the given blocks. An fp8 cache takes fp8
        pages only (their bytes, as a peer stored them with the same scales): anything else would need the scales
        and is a caller's bug.

        Blocks whose ids run consecutively are copied straight into the pool's slice (a request's blocks mostly
        do): on the CPU VM 7-9 ms per 134 MB of pages against 15-25 ms for an indexed put, which also makes a
        device copy of the pages first. Scattered blocks take the indexed put."""
        pages = self.tensor[layer]  # [2, num_blocks, block_size, Hkv, D]
        if self.is_fp8:
            if k.dtype != self.dtype or v.dtype != self.dtype:
                raise ValueError(f"write_blocks: an {self.dtype} cache takes {self.dtype} pages, got {k.dtype}, "
                                 f"{v.dtype}")
            # As bytes: index_put on fp8 tensors is not implemented on every device.
            pages, k, v = pages.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        runs = _consecutive_runs(block_ids, MAX_SLICED_RUNS)
        if runs is not None:
            for first_block, start, count in runs:
                pages[0, first_block:first_block + count].copy_(k[start:start + count])
                pages[1, first_block:first_block + count].copy_(v[start:start + count])
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        pages[0, index] = k.to(self.tensor.device, pages.dtype)
        pages[1, index] = v.to(self.tensor.device, pages.dtype)

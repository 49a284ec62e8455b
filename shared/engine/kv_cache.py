"""The paged KV cache: one device tensor, addressed by block id (the block pool hands the ids out)."""

from __future__ import annotations

import torch

from tandem.common.config import CacheConfig, ConfigError, KVLayout, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * itemsize


def num_blocks_to_allocate(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                           device: torch.device, max_model_len: int) -> int:
    """Explicit size, else what the memory budget holds; at least one maximal request must fit."""
    per_block = bytes_per_block(model, cache.block_size, dtype)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # The fraction caps this process's use of the GPU (weights, activations, KV), so several workers
        # can share one device by each taking its own share; what others hold is respected through
        # `free`, less a margin for CUDA graphs and the allocator.
        used_here = torch.cuda.memory_reserved(device)
        budget = min(int(total * cache.gpu_memory_fraction) - used_here, free - (2 << 30))
        num_blocks = max(budget, 0) // per_block
    else:
        num_blocks = cache.cpu_kv_bytes // per_block
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"num_blocks: the KV pool holds {num_blocks} blocks of {cache.block_size} tokens but one "
            f"request of max_model_len={max_model_len} tokens needs {needed}; raise the KV memory or "
            f"lower max_model_len")
    return num_blocks


class KVCache:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] on one device."""

    def __init__(self, model: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.tensor = torch.zeros(model.num_hidden_layers, 2, num_blocks, block_size,
                                  model.num_key_value_heads, model.head_dim, dtype=dtype, device=device)
        self.layout = KVLayout(dtype=str(dtype).removeprefix("torch."), block_size=block_size,
                               num_layers=model.num_hidden_layers, num_kv_heads=model.num_key_value_heads,
                               head_dim=model.head_dim, model_fingerprint=model.fingerprint())

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]: views, no copies."""
        return [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(self.tensor.shape[0])]

    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's K and V pages, each [len(block_ids), block_size, Hkv, D]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor[layer, 0, index], self.tensor[layer, 1, index]

    def write_blocks(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write pages (each [len(block_ids), block_size, Hkv, D]) into the given blocks."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        self.tensor[layer, 0, index] = k.to(self.tensor.device, self.dtype)
        self.tensor[layer, 1, index] = v.to(self.tensor.device, self.dtype)

"""`KVCache.write_blocks`: pages land in exactly the blocks named, whether the ids run consecutively (copied into the
pool's slices) or are scattered (one indexed put), in the model's dtype and as fp8 bytes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.kv_cache import KVCache, _consecutive_runs
from tandem.kernels.fp8_kv import FP8_KV_DTYPE
from tandem.models import load_model_config

NUM_BLOCKS = 24
MODEL = load_model_config("dummy:tiny", fetch=False)


def test_runs_of_consecutive_ids() -> None:
    assert _consecutive_runs([]) == []
    assert _consecutive_runs([7]) == [(7, 0, 1)]
    assert _consecutive_runs([3, 4, 5, 9, 10, 2]) == [(3, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert _consecutive_runs([5, 4]) == [(5, 0, 1), (4, 1, 1)]  # descending ids are separate runs


def _block_lists() -> st.SearchStrategy[list[int]]:
    """Distinct block ids: a few runs of consecutive ids (mostly at most MAX_SLICED_RUNS: sliced), or 10 ids drawn
    at random from 24 (mostly more runs than that: the indexed put)."""
    runs = st.lists(st.tuples(st.integers(0, NUM_BLOCKS - 1), st.integers(1, 6)), min_size=1, max_size=8)

    def flatten(pairs: list[tuple[int, int]]) -> list[int]:
        ids: list[int] = []
        for first, count in pairs:
            ids += [b for b in range(first, min(first + count, NUM_BLOCKS)) if b not in ids]
        return ids

    return st.one_of(runs.map(flatten), st.permutations(range(NUM_BLOCKS)).map(lambda ids: list(ids[:10])))


@settings(max_examples=60, deadline=None)
@given(block_ids=_block_lists(), fp8=st.booleans(), layer=st.integers(0, MODEL.num_hidden_layers - 1))
def test_pages_land_in_the_named_blocks_only(block_ids: list[int], fp8: bool, layer: int) -> None:
    dtype = FP8_KV_DTYPE if fp8 else torch.float32
    cache = KVCache(MODEL, 4, NUM_BLOCKS, dtype, torch.device("cpu"))
    before = cache.tensor.clone()
    shape = (len(block_ids), 4, MODEL.num_key_value_heads, MODEL.head_dim)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    cache.write_blocks(layer, block_ids, k, v)
    expected = before.clone()
    as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    for i, block_id in enumerate(block_ids):
        as_bytes(expected)[layer, 0, block_id] = as_bytes(k[i])
        as_bytes(expected)[layer, 1, block_id] = as_bytes(v[i])
    assert torch.equal(as_bytes(cache.tensor), as_bytes(expected))
    read_k, read_v = cache.read_blocks(layer, block_ids)
    assert torch.equal(as_bytes(read_k), as_bytes(k)) and torch.equal(as_bytes(read_v), as_bytes(v))


def test_pages_in_another_dtype_are_cast_into_the_pool() -> None:
    cache = KVCache(MODEL, 4, NUM_BLOCKS, torch.bfloat16, torch.device("cpu"))
    shape = (2, 4, MODEL.num_key_value_heads, MODEL.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)  # float32 pages into a bf16 pool, as a float32 peer's would be
    cache.write_blocks(0, [6, 7], k, v)
    read_k, read_v = cache.read_blocks(0, [6, 7])
    assert torch.equal(read_k, k.to(torch.bfloat16)) and torch.equal(read_v, v.to(torch.bfloat16))

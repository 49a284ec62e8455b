"""`PageExporter`: a layer's pages become the same messages as a direct read, delivered in submission
order off the calling thread, and `flush` waits for all of them (on a GPU: through the side stream)."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.serving.kv_transfer import PageExporter, pages_to_messages
from tandem.v1 import worker_pb2

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_pages_arrive_in_order_and_equal_a_direct_read(device: str) -> None:
    torch.manual_seed(0)
    # [layers, K/V, blocks, block_size, kv_heads, head_dim]; bf16, as served on a GPU.
    cache = torch.randn(3, 2, 20, 4, 3, 8, device=device).to(torch.bfloat16)
    exporter = PageExporter(cache)
    delivered: list[tuple[str, int, list[worker_pb2.KVPages], str]] = []
    # Two requests of one step; blocks out of order, as a pool hands them out.
    requests = [("a", 0, [7, 2, 19, 3]), ("b", 2, [11])]  # b: its third block (a later chunk of its prompt)
    for _ in range(2):  # two steps: the second reuses the first one's staging buffers
        layer_done = exporter.begin_step(requests, lambda req_id, messages: delivered.append(
            (req_id, messages[0].layer, messages, threading.current_thread().name)))
        for layer in range(3):
            layer_done(layer)
    exporter.flush().result(timeout=30)
    exporter.close()
    assert [(req_id, layer) for req_id, layer, _, _ in delivered] == [
        (req_id, layer) for _ in range(2) for layer in range(3) for req_id in ("a", "b")]
    assert all(name.startswith("kv-export") for _, _, _, name in delivered)
    blocks = {req_id: (first, ids) for req_id, first, ids in requests}
    for req_id, layer, messages, _ in delivered:
        first, ids = blocks[req_id]
        index = torch.tensor(ids, device=device)
        expected = list(pages_to_messages(layer, cache[layer, 0, index].cpu(), cache[layer, 1, index].cpu(),
                                          first_block=first))
        assert messages == expected and messages[0].block_start == first

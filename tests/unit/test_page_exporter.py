"""`PageExporter`: a layer's pages become the same messages as a direct read, delivered in submission
order off the calling thread, and `flush` waits for all of them (on a GPU: through the side stream). The wire
format they are written in reads back, through protobuf and through the receiver's own reader, as the messages
protobuf would have made; anything the reader does not take apart goes to protobuf."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.config import KVLayout
from tandem.serving.kv_transfer import (
    PageExporter,
    PagesView,
    WirePages,
    messages_to_pages,
    pages_to_messages,
    pages_to_wire,
    parse_prefill_response,
    serialize_prefill_response,
)
from tandem.v1 import worker_pb2

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_pages_arrive_in_order_and_equal_a_direct_read(device: str) -> None:
    torch.manual_seed(0)
    # [layers, K/V, blocks, block_size, kv_heads, head_dim]; bf16, as served on a GPU.
    cache = torch.randn(3, 2, 20, 4, 3, 8, device=device).to(torch.bfloat16)
    exporter = PageExporter(cache)
    delivered: list[tuple[str, int, list[WirePages], str]] = []
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
        assert [worker_pb2.PrefillResponse.FromString(m.data).pages for m in messages] == expected
        assert [(m.layer, m.block_start, m.num_blocks) for m in messages] == [
            (e.layer, e.block_start, e.num_blocks) for e in expected]
        assert messages[0].block_start == first


def _as_message(view: PagesView) -> worker_pb2.KVPages:
    return worker_pb2.KVPages(layer=view.layer, block_start=view.block_start, num_blocks=view.num_blocks,
                              k=bytes(view.k), v=bytes(view.v), crc32=view.crc32)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 9), layer=st.integers(0, 300), first_block=st.integers(0, 70_000),
       chunk_bytes=st.sampled_from([1, 200, 1000, 1 << 20]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       gathered=st.booleans(), seed=st.integers(0, 2**16))
def test_the_wire_format_reads_back_as_protobuf_s_messages(num_blocks: int, layer: int, first_block: int,
                                                           chunk_bytes: int, dtype: torch.dtype, gathered: bool,
                                                           seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, 4, 2, 8, generator=generator).to(dtype)
    v = torch.randn(num_blocks, 4, 2, 8, generator=generator).to(dtype)
    expected = list(pages_to_messages(layer, k, v, max_chunk_bytes=chunk_bytes, first_block=first_block))
    if gathered:  # the pages picked out of a larger pool, in any order, as the exporter does on a CPU
        rows = torch.randperm(num_blocks + 5, generator=generator)[:num_blocks]
        k_pool = torch.zeros(num_blocks + 5, 4, 2, 8, dtype=dtype)
        v_pool = torch.zeros_like(k_pool)
        k_pool[rows], v_pool[rows] = k, v
        wire = list(pages_to_wire(layer, k_pool, v_pool, max_chunk_bytes=chunk_bytes, first_block=first_block,
                                  rows=rows))
    else:
        wire = list(pages_to_wire(layer, k, v, max_chunk_bytes=chunk_bytes, first_block=first_block))
    assert [worker_pb2.PrefillResponse.FromString(w.data) for w in wire] == [
        worker_pb2.PrefillResponse(pages=m) for m in expected]
    views = [parse_prefill_response(w.data) for w in wire]
    assert all(isinstance(view, PagesView) for view in views)
    assert [_as_message(view) for view in views] == expected  # type: ignore[arg-type]
    assert all(serialize_prefill_response(w.data) is w.data for w in wire)  # sent as they are


def test_a_flipped_byte_anywhere_in_the_pages_fails_the_checksum() -> None:
    layout = KVLayout("bfloat16", 4, 1, 2, 8, "test")
    k, v = torch.randn(3, 4, 2, 8).to(torch.bfloat16), torch.randn(3, 4, 2, 8).to(torch.bfloat16)
    (wire,) = pages_to_wire(0, k, v)
    view = parse_prefill_response(wire.data)
    assert isinstance(view, PagesView)
    got_k, got_v = messages_to_pages(view, layout)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    v_at = len(wire.data) - len(view.v)  # v comes last, after its key and length (3 bytes here)
    for at in (v_at - 3 - len(view.k), v_at - 4, len(wire.data) - 1):  # k's first byte, k's last, v's last
        damaged = bytearray(wire.data)
        damaged[at] ^= 0x01
        damaged_view = parse_prefill_response(bytes(damaged))
        assert isinstance(damaged_view, PagesView)
        with pytest.raises(ValueError, match="CRC32"):
            messages_to_pages(damaged_view, layout)


def test_the_reader_takes_protobuf_s_own_encoding_and_leaves_the_rest_to_it() -> None:
    pages = worker_pb2.KVPages(layer=3, block_start=2**32 - 1, num_blocks=1, k=b"\x01" * 300, v=b"", crc32=7)
    view = parse_prefill_response(worker_pb2.PrefillResponse(pages=pages).SerializeToString())
    assert isinstance(view, PagesView) and _as_message(view) == pages
    # A field repeated: the last value wins, as in protobuf.
    twice = (worker_pb2.KVPages(layer=1).SerializeToString() + worker_pb2.KVPages(layer=5).SerializeToString())
    view = parse_prefill_response(worker_pb2.PrefillResponse(pages=worker_pb2.KVPages.FromString(twice))
                                  .SerializeToString())
    assert isinstance(view, PagesView) and view.layer == 5
    first = worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(token_id=9, logprob=-0.5, prefill_s=0.1))
    assert parse_prefill_response(first.SerializeToString()) == first
    assert serialize_prefill_response(first) == first.SerializeToString()
    # A field of the wrong wire type is not the reader's to judge: protobuf's parser decides.
    odd = bytes([1 << 3 | 0, 5])  # PrefillResponse field 1 as a varint
    assert parse_prefill_response(odd) == worker_pb2.PrefillResponse.FromString(odd)
    fixed_layer = bytes([1 << 3 | 5]) + (9).to_bytes(4, "little")  # KVPages.layer as a fixed32: an unknown field
    odd = bytes([1 << 3 | 2, len(fixed_layer)]) + fixed_layer
    assert parse_prefill_response(odd) == worker_pb2.PrefillResponse.FromString(odd)
    assert worker_pb2.PrefillResponse.FromString(odd).pages.layer == 0
    for bad in (b"\x00\x05", b"\x80\x80\x80\x80\x10\x05"):  # field numbers 0 and 2**29: protobuf refuses them
        with pytest.raises(Exception, match="(?i)error|pars"):
            parse_prefill_response(bytes([1 << 3 | 2, len(bad)]) + bad)
    with pytest.raises(Exception, match="(?i)error|truncat"):  # protobuf's DecodeError
        parse_prefill_response(worker_pb2.PrefillResponse(pages=pages).SerializeToString()[:-5])

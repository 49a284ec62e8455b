"""Block tables from rows kept on the requests (`table_row`): whatever happens to a request's blocks between steps
(it grows, it is trimmed after a verify step, preempted and readmitted, re-pointed at cached blocks), the table a
step builds holds exactly its `block_ids`, padded with zeros."""

from __future__ import annotations

import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.sampling_params import SamplingParams
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner, slot_mapping, table_row
from tests.unit.test_quantization import tiny_config


def encoded(ids: list[int]) -> bytes:
    return array.array("i", ids).tobytes()


def make_request(req_id: str, num_tokens: int, block_ids: list[int]) -> Request:
    request = Request(req_id=req_id, prompt_token_ids=list(range(100, 100 + num_tokens)),
                      params=SamplingParams(max_tokens=64), seed=0)
    request.block_ids = block_ids
    return request


# Each operation as the engine does it: grow in place (a decode step's new block, a chunk's blocks), trim to a new
# list (`Scheduler._trim`), free and readmit (a new list), point at other blocks (a prefix hit: a new list).
operation = st.one_of(
    st.tuples(st.just("grow"), st.lists(st.integers(0, 10_000), min_size=1, max_size=5)),
    st.tuples(st.just("trim"), st.integers(0, 8)),
    st.tuples(st.just("replace"), st.lists(st.integers(0, 10_000), max_size=12)),
    st.tuples(st.just("read"), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(operation, max_size=30))
def test_a_row_follows_its_block_ids_through_every_change(operations: list[tuple[str, object]]) -> None:
    request = make_request("r", 1, [7])
    assert table_row(request) == encoded([7])
    for kind, arg in operations:
        if kind == "grow":
            request.block_ids += arg  # type: ignore[operator]
        elif kind == "trim":
            request.block_ids = request.block_ids[:arg]  # type: ignore[misc]
        elif kind == "replace":
            request.block_ids = list(arg)  # type: ignore[call-overload]
        assert table_row(request) == encoded(request.block_ids)


def test_a_trimmed_list_that_grows_back_to_its_old_length_is_encoded_anew() -> None:
    """The case identity catches and a length check alone would not: same length as last encoded, other ids."""
    request = make_request("r", 1, [1, 2, 3])
    assert table_row(request) == encoded([1, 2, 3])
    request.block_ids = request.block_ids[:1]  # as Scheduler._trim does
    request.block_ids += [8, 9]
    assert table_row(request) == encoded([1, 8, 9])


def test_decode_and_mixed_steps_build_their_tables_from_the_rows() -> None:
    runner = ModelRunner(tiny_config())
    block_size = runner.block_size
    requests = [make_request("a", 2 * block_size, [4, 5, 6]), make_request("b", block_size, [9]),
                make_request("c", 2 * block_size - 1, [2, 3])]

    def expected() -> torch.Tensor:
        width = max(len(r.block_ids) for r in requests)
        return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in requests], dtype=torch.int32)

    for change in range(4):
        assert torch.equal(runner.prepare_decode(requests).block_tables, expected())
        assert torch.equal(runner._block_tables(requests), expected())
        if change == 0:
            requests[1].block_ids += [11, 12, 13]  # grows past the others: the table widens
        elif change == 1:
            requests[0].block_ids = requests[0].block_ids[:1]  # trimmed
            requests[0].block_ids += [30]
        elif change == 2:
            requests[2].block_ids = [40, 41]  # readmitted elsewhere, same length


@settings(max_examples=300, deadline=None)
@given(block_size=st.sampled_from([1, 2, 16]), data=st.data())
def test_slot_mapping_is_each_positions_slot(block_size: int, data: st.DataObject) -> None:
    """`slot_mapping` (a range per block) gives every position its page's slot, as the per-token formula does, for
    any span: inside one block, across blocks, starting or ending mid-block, empty."""
    num_blocks = data.draw(st.integers(1, 12))
    block_ids = data.draw(st.lists(st.integers(0, 10_000), min_size=num_blocks, max_size=num_blocks, unique=True))
    start = data.draw(st.integers(0, num_blocks * block_size))
    end = data.draw(st.integers(start, num_blocks * block_size))
    expected = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
    assert slot_mapping(block_ids, start, end, block_size) == expected

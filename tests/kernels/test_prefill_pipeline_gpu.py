"""Prefill pipelining on a GPU, where a launched step really runs ahead of the host: the same first tokens as steps
run one at a time, and an abort of a request that a launched step computes for returns only once that step is done
(its stores may target a receiver's pool)."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.common.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import RequestStatus
from tandem.models import load_model_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


def engine(pipelined: bool) -> Engine:
    config = EngineConfig.create(load_model_config("dummy:smollm2-135m"), device="cuda", max_model_len=1024,
                                 max_num_batched_tokens=512, num_kv_blocks=512, async_scheduling=pipelined)
    result = Engine(config)
    assert result.pipeline_prefill == pipelined
    return result


def prompts(wave: int) -> list[list[int]]:
    return [[(13 * i + 7 * j + wave) % 40000 + 2 for j in range(60 + 170 * i)] for i in range(5)]


def test_first_tokens_equal_steps_one_at_a_time_on_the_gpu() -> None:
    """The same prompts queued at once (so both schedules batch alike), over steps of 512 tokens."""
    firsts = {}
    for pipelined in (False, True):
        e = engine(pipelined)
        for wave in range(4):
            for i, prompt in enumerate(prompts(wave)):
                e.add_request(f"{wave}-{i}", prompt, PARAMS, prefill_only=True)
        got: dict[str, int] = {}
        ahead = 0
        while e.has_unfinished():
            for request in e.step().requests:
                # Pipelined, a prompt whose last chunk the launched step computes is PREFILLED with no token yet.
                if request.status is RequestStatus.PREFILLED and request.output_token_ids:
                    got[request.req_id] = request.output_token_ids[0]
                    e.release(request.req_id)
            ahead += e._prefill_in_flight is not None
        assert len(got) == 20
        assert (ahead > 5) == pipelined
        assert e.num_free_blocks == e.num_total_blocks
        firsts[pipelined] = got
        del e
        torch.cuda.empty_cache()
    assert firsts[True] == firsts[False]


def test_an_abort_waits_for_the_launched_step_that_computes_for_it() -> None:
    e = engine(True)
    for i, prompt in enumerate(prompts(0)):
        e.add_request(f"a{i}", prompt, PARAMS, prefill_only=True)
    def release_prefilled(requests) -> None:
        for request in requests:
            if request.status is RequestStatus.PREFILLED and request.output_token_ids:
                e.release(request.req_id)

    # Reads the first step, with the second launched behind it. The prompts that the first step finished are
    # released like any other (they hold blocks until then).
    first = e.step().requests
    in_flight = e._prefill_in_flight
    assert in_flight is not None
    member = next(r for r in in_flight.output.requests)
    assert member.req_id not in {r.req_id for r in first if r.output_token_ids}
    e.abort(member.req_id)
    assert in_flight.launched.done is not None and in_flight.launched.done.query()
    release_prefilled(first)
    while e.has_unfinished():
        requests = e.step().requests
        assert all(r.req_id != member.req_id or r.status is not RequestStatus.PREFILLED for r in requests)
        release_prefilled(requests)
    assert e.num_free_blocks == e.num_total_blocks

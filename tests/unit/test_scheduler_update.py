"""A pure decode step's update (`Scheduler.update_decodes`, the fast path) has the same effects as the general
`update_from_output`: two schedulers driven in lockstep through the same random workload, one forced down the
general path, end every step in the same state."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.config import SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.engine.step_plan import SchedulerOutput

EOS = 2
STOP = 3
BLOCK = 4


class GeneralPath(SchedulerOutput):
    """The same step, never taken for a pure decode one: `update_from_output` runs its general loop."""

    @property
    def is_pure_decode(self) -> bool:
        return False


def make_scheduler() -> Scheduler:
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, enable_chunked_prefill=True)
    return Scheduler(config, BlockPool(24), BLOCK, (EOS,), prefix_key=b"test-model")


def state(scheduler: Scheduler, requests: dict[str, Request]) -> object:
    return ([r.req_id for r in scheduler.running], scheduler.block_pool.num_free_blocks,
            scheduler.block_pool.num_cached_blocks,
            {req_id: (r.status, r.num_computed_tokens, r.output_token_ids, r.output_logprobs, r.block_ids,
                      r.num_registered_blocks, r.num_draft_tokens, r.num_accepted_tokens, dict(r.local_prefill_tokens))
             for req_id, r in requests.items()})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_decode_fast_path_matches_the_general_update(seed: int) -> None:
    rng = random.Random(seed)
    fast, general = make_scheduler(), make_scheduler()
    requests: list[dict[str, Request]] = [{}, {}]
    num_pure_decode = 0
    for step in range(60):
        if rng.random() < 0.3:  # arrivals: shared prefixes (cache hits), stop tokens, EOS ignored or not
            req_id = f"r{step}"
            prefix = [7, 8, 9, 10, 11, 12, 13, 14][:rng.randrange(0, 9)]
            prompt = prefix + [rng.randrange(20, 40) for _ in range(rng.randrange(1, 10))]
            params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=rng.random() < 0.3,
                                    stop_token_ids=(STOP,) if rng.random() < 0.5 else ())
            for scheduler, known in zip((fast, general), requests, strict=True):
                request = Request(req_id=req_id, prompt_token_ids=list(prompt), params=params, seed=0)
                known[req_id] = request
                scheduler.add(request)
        if rng.random() < 0.05 and fast.running:  # an abort between steps
            victim = rng.choice(fast.running).req_id
            for scheduler, known in zip((fast, general), requests, strict=True):
                scheduler.finish(known[victim], known[victim].status.FINISHED_ABORTED)
        out_fast, out_general = fast.schedule(), general.schedule()
        if out_fast is None:
            assert out_general is None
            continue
        assert out_general is not None
        assert ([r.req_id for r in out_fast.requests], out_fast.num_new_tokens) == (
            [r.req_id for r in out_general.requests], out_general.num_new_tokens)
        num_sampling = sum(out_fast.samples(i) for i in range(len(out_fast.requests)))
        tokens = [[rng.choice([EOS, STOP, 21, 22, 23, 24, 25])] for _ in range(num_sampling)]
        logprobs = [[-rng.random()] for _ in range(num_sampling)]
        num_pure_decode += out_fast.is_pure_decode
        general_output = GeneralPath(**{f.name: getattr(out_general, f.name)
                                        for f in dataclasses.fields(out_general)})
        finished_fast = fast.update_from_output(out_fast, tokens, logprobs)
        finished_general = general.update_from_output(general_output, tokens, logprobs)
        assert [r.req_id for r in finished_fast] == [r.req_id for r in finished_general]
        assert state(fast, requests[0]) == state(general, requests[1])
    fast.block_pool.check_integrity()
    assert num_pure_decode > 0 or not requests[0]

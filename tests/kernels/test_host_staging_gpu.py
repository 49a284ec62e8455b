"""A step's inputs through reused pinned arenas (`HostStaging`): the values the device receives, an arena written
again only after its copies ran, the fallback past an arena's end, and the same tokens as pinning each input."""

from __future__ import annotations

import array

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.staging import STAGING_ENV, HostStaging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_inputs_reach_the_device_through_the_ring() -> None:
    staging = HostStaging(arena_bytes=4096, num_arenas=2)
    received = []
    for step in range(7):  # wraps the ring three times
        with staging.step():
            ids = staging.tensor(array.array("q", range(step, step + 100)), torch.int64)
            lens = staging.tensor(array.array("i", [step] * 33), torch.int32)
            assert ids.is_pinned() and lens.is_pinned()
            # A slow kernel ahead of the copies: the next write into this arena must wait for them.
            torch.cuda._sleep(2_000_000)
            received.append((ids.to("cuda", non_blocking=True), lens.to("cuda", non_blocking=True)))
    for step, (ids, lens) in enumerate(received):
        assert ids.tolist() == list(range(step, step + 100))
        assert lens.tolist() == [step] * 33
    assert staging.num_fallbacks == 0


def test_past_the_arena_and_outside_a_step_inputs_are_pinned_on_their_own() -> None:
    staging = HostStaging(arena_bytes=1024, num_arenas=2)
    with staging.step():
        big = staging.tensor(array.array("q", range(200)), torch.int64)  # 1,600 bytes
        empty = staging.tensor(array.array("q"), torch.int64)
    assert big.is_pinned() and big.tolist() == list(range(200)) and empty.numel() == 0
    assert staging.num_fallbacks == 1
    alone = staging.tensor(array.array("i", [5, 6]), torch.int32)
    assert alone.is_pinned() and alone.tolist() == [5, 6]


def test_tokens_equal_inputs_pinned_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[(5 * i + 7 * j) % 400 + 3 for j in range(4 + 11 * i)] for i in range(10)]
    params = [SamplingParams(max_tokens=30 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    outputs = {}
    for staged in ("1", "0"):
        monkeypatch.setenv(STAGING_ENV, staged)
        llm = LLM("dummy:tiny", device="cuda", max_model_len=256, max_num_seqs=16, num_kv_blocks=256,
                  async_scheduling=True)
        assert (llm.engine.runner.staging is not None) == (staged == "1")
        outputs[staged] = [o.token_ids for o in llm.generate(prompts, params)]
        if staged == "1":
            assert llm.engine.runner.staging.num_fallbacks == 0
        del llm
        torch.cuda.empty_cache()
    assert outputs["1"] == outputs["0"]

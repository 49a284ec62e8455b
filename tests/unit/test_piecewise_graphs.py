"""Piecewise execution of steps with prompt tokens: the model's pieces over static, padded buffers with the attentions
between them give the tokens of the plain forward. On the CPU the pieces run uncaptured (`use_eager_pieces`), which
checks everything but the capture itself (tests/kernels/test_cuda_graphs.py captures them on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.cuda_graphs import TOKEN_BUCKETS, PiecewiseGraphs, cheapest_buckets
from tests.factories import hf_greedy, prompts_for, save_random_hf_model


def with_pieces(llm: LLM, max_tokens: int, max_decodes: int = 8, decode_batches: list[int] | None = None
                ) -> list[tuple[int, int, bool]]:
    """Give `llm`'s runner uncaptured pieces; returns (tokens, bucket, whether chunks attended to context) of every
    step they ran. `decode_batches` collects the batch bucket of every decode-attention "replay"."""
    runner = llm.engine.runner
    pieces = PiecewiseGraphs(runner, max_tokens=max_tokens, max_decodes=max_decodes)
    decode_attention = pieces._decode_attention

    def counting(i: int, num_seqs: int) -> object:
        if decode_batches is not None and i == 0:
            decode_batches.append(num_seqs)
        return decode_attention(i, num_seqs)

    pieces._decode_attention = counting  # type: ignore[method-assign]
    pieces.use_eager_pieces()
    runs: list[tuple[int, int, bool]] = []
    run = pieces.run

    def recording(input_ids, positions, slot_mapping, num_tokens, meta, on_layer_done=None):  # type: ignore[no-untyped-def]
        runs.append((num_tokens, input_ids.shape[0], meta.seq_lens is not None))
        return run(input_ids, positions, slot_mapping, num_tokens, meta, on_layer_done)

    pieces.run = recording  # type: ignore[method-assign]
    runner.mixed_graphs = pieces
    return runs


def test_pieces_give_the_plain_forward_tokens(tmp_path: Path) -> None:
    hf = save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [70, 3, 45, 17, 33, 100])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=48, block_size=8)
    pieced = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=48, block_size=8)
    decode_batches: list[int] = []
    runs = with_pieces(pieced, 48, max_decodes=4, decode_batches=decode_batches)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in pieced.generate(prompts, params)] == expected
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert tokens == hf_greedy(hf, prompt, 10)
    # Mixed and prompt-only steps went through the pieces, padded up to their bucket.
    assert runs and all(tokens <= bucket for tokens, bucket, _ in runs)
    assert any(tokens < bucket for tokens, bucket, _ in runs), "some step should have needed padding rows"
    assert {bucket for _, bucket, _ in runs} <= set(TOKEN_BUCKETS)
    # The decode tokens of mixed steps took their batch bucket's "graph" (padded: 3 decodes in the 4 bucket) while
    # they fit (4), their eager attention beyond.
    assert decode_batches and set(decode_batches) <= {1, 2, 4}
    pieced.engine.block_pool.check_integrity()
    assert pieced.engine.num_free_blocks == pieced.engine.num_total_blocks


def test_pieces_with_prefix_hits_and_seeded_sampling(tmp_path: Path) -> None:
    """Later chunks and prefix-cache hits attend to context through the paged prefill kernel between the pieces."""
    save_random_hf_model(tmp_path)
    system = prompts_for(512, [40])[0]
    prompts = [system + p for p in prompts_for(512, [5, 23, 11])]
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    plain = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=32, block_size=4)
    pieced = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=32, block_size=4)
    runs = with_pieces(pieced, 32, max_decodes=2)
    for llm in (plain, pieced):
        llm.generate(prompts[:1], params)  # caches the shared prefix
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in pieced.generate(prompts, params)] == expected
    assert any(has_context for _, _, has_context in runs)


def test_steps_past_the_largest_bucket_run_eagerly(tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=64, block_size=8)
    runs = with_pieces(llm, 16)
    assert llm.engine.runner.mixed_graphs is not None and llm.engine.runner.mixed_graphs.buckets[-1] == 16
    prompt = prompts_for(512, [60])[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)
    assert not runs  # the 60-token prompt step is past 16 tokens: the plain forward


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 2048, 20_000])
def test_buckets_cover_the_budget(tmp_path: Path, max_tokens: int) -> None:
    save_random_hf_model(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64, block_size=8)
    pieces = PiecewiseGraphs(llm.engine.runner, max_tokens=max_tokens)
    assert pieces.buckets == sorted(pieces.buckets)
    assert pieces.buckets[-1] >= min(max_tokens, TOKEN_BUCKETS[-1])
    assert pieces.can_run(min(max_tokens, TOKEN_BUCKETS[-1])) and not pieces.can_run(0)
    assert pieces.input_ids.shape[0] == pieces.buckets[-1]
    assert pieces.q.dtype == torch.float32


def test_cheapest_buckets_take_a_larger_bucket_only_when_measured_faster() -> None:
    buckets = [16, 32, 48, 64, 96]
    # 48 replays slower than 64 (as cuBLAS's pick made the H200's 448 slower than its 512): 33-48 take 64.
    route = cheapest_buckets(buckets, {16: 1.0, 32: 2.0, 48: 5.0, 64: 3.0, 96: 4.0})
    assert route == {16: 16, 32: 32, 48: 64, 64: 64, 96: 96}
    # Within 3% is noise: no padding added for it. A run of slow buckets all go to the first fast one past them.
    assert cheapest_buckets(buckets, {16: 1.0, 32: 2.0, 48: 3.0, 64: 2.95, 96: 4.0})[48] == 48
    assert cheapest_buckets(buckets, {16: 9.0, 32: 9.0, 48: 9.0, 64: 2.0, 96: 4.0}) == {
        16: 64, 32: 64, 48: 64, 64: 64, 96: 96}
    assert all(to >= size for size, to in cheapest_buckets(buckets, dict.fromkeys(buckets, 1.0)).items())


def test_a_size_routed_to_a_larger_bucket_gives_the_same_tokens(tmp_path: Path) -> None:
    """Steps that replay a larger bucket than the smallest that holds them (more padding rows) lose nothing."""
    save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [70, 3, 45, 17, 33, 100])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=48, block_size=8)
    pieced = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=48, block_size=8)
    runs = with_pieces(pieced, 48, max_decodes=4)
    pieces = pieced.engine.runner.mixed_graphs
    assert pieces is not None and pieces.buckets == [16, 32, 48]
    pieces.bucket.route = cheapest_buckets(pieces.buckets, {16: 3.0, 32: 2.0, 48: 1.0})
    for batch in (prompts, prompts_for(512, [20])):  # the second: a step of 20 tokens
        expected = [o.token_ids for o in plain.generate(batch, params)]
        assert [o.token_ids for o in pieced.generate(batch, params)] == expected
    assert runs and {bucket for _, bucket, _ in runs} == {48}
    assert any(tokens <= 32 for tokens, _, _ in runs), "a step of at most 32 tokens should have replayed 48"

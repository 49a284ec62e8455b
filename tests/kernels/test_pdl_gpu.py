"""Programmatic dependent launch ($TANDEM_PDL=1) on a Hopper GPU: the decode path's kernels overlap their launch with
the previous kernel's tail, inside CUDA graphs too, and nothing they compute changes: the same tokens and the same
logprobs as with PDL off, for bf16, int8 and fp8 weights, at batch sizes with and without split-K and split
attention."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels import _triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _generate(monkeypatch: pytest.MonkeyPatch, pdl: bool, quantization: str | None
              ) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setenv(_triton.PDL_ENV, "1" if pdl else "0")
    _triton.pdl_requested.cache_clear()
    try:
        assert _triton.use_pdl(torch.device("cuda")) == pdl
        llm = LLM("dummy:tiny", device="cuda", max_model_len=512, max_num_seqs=16, num_kv_blocks=512,
                  quantization=quantization)
        prompts = [[(11 * i + 5 * j) % 400 + 3 for j in range(4 + 37 * i)] for i in range(9)]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        single = llm.generate(prompts[:1], params)  # batch 1: the small-M path and split attention
        result = [(o.token_ids, list(o.logprobs)) for o in outputs + single]
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
        del llm
        torch.cuda.empty_cache()
        return result
    finally:
        _triton.pdl_requested.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs compute capability 9.0 (Hopper) or later")
@pytest.mark.parametrize("quantization", [None, "int8", pytest.param("fp8", marks=pytest.mark.xfail(
    strict=False, reason="on an H100 (2026-12-07) fp8 gave the same tokens but other logprobs with PDL on, "
    "deterministically, only inside CUDA graphs and only for a 4-token prompt (the small-M kernel's tensor-core "
    "variant); why is not known, which is why $TANDEM_PDL stays off by default"))])
def test_pdl_changes_no_token_and_no_logprob(monkeypatch: pytest.MonkeyPatch, quantization: str | None) -> None:
    off = _generate(monkeypatch, False, quantization)
    on = _generate(monkeypatch, True, quantization)
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    assert [lps for _, lps in on] == [lps for _, lps in off]

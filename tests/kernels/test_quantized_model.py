"""Quantized weights and the fp8 KV cache on the engine's Triton path (Triton's interpreter on the CPU): the
kernels run (`int8_linear_triton`, `fp8_linear_triton`, the fp8 writers and readers), and the logits match the
reference path's (the CPU int8 kernel, the fp8 emulation, the torch attention references) on the same weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.quantization import QuantizedLinear
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.kernels import get_ops
from tandem.models import load_model_config


def runner(backend: str, quantization: str | None, kv_cache_dtype: str) -> ModelRunner:
    model = replace(load_model_config("dummy:tiny", fetch=False), quantization=quantization)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=8, num_blocks=16, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_model_len=64))
    r = ModelRunner(config, ops=get_ops(backend))
    if r.kv_cache.scales is not None:
        # Scales that are not 1 (the engine's static default), one per layer, K|V and head, written into the cache's
        # tensor: a writer or reader that missed its layer's scale would be off by 50-500x. dummy:tiny's K and V
        # stay below ~0.3, so x / scale lands inside e4m3's normal range.
        scales = torch.linspace(0.002, 0.02, r.kv_cache.scales.numel()).reshape(r.kv_cache.scales.shape)
        r.kv_cache.scales.copy_(scales)
    return r


def logits_of_steps(r: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Logits [3, V] of: a prompt chunk at position 0 (contiguous prefill attention), the rest of the prompt over
    the first chunk's pages (paged prefill attention), then one decode step (paged decode attention)."""
    request = Request(req_id="q", prompt_token_ids=prompt, params=SamplingParams(max_tokens=2), seed=0)
    request.block_ids = [3, 9, 1, 6]  # scattered
    split = 11
    first = r.chunk_logits([(request, 0, split)], [1])
    second = r.chunk_logits([(request, split, len(prompt) - split)], [1])
    request.output_token_ids.append(int(second.argmax()))
    request.num_computed_tokens = len(prompt)
    decoded = r.decode_logits([request])
    return torch.cat([first, second, decoded])


@pytest.mark.parametrize(("quantization", "kv_cache_dtype", "rel_tol"), [
    ("int8", "auto", 1e-2),  # the CPU int8 kernel rounds activations to bf16; the Triton one keeps fp32 (~0.2-0.5%)
    ("fp8", "auto", 1e-5),   # both emulate the same fp8 arithmetic with fp32 accumulation (~2e-7)
    (None, "fp8", 1e-5),     # the same e4m3 codes written (bit for bit), read with the scale folded in (~2e-7)
    ("int8", "fp8", 1e-2),
], ids=["int8", "fp8", "fp8-kv", "int8-fp8-kv"])
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="compares fp32 CPU engines (Triton's interpreter vs the torch "
                    "references); on a GPU test_quant_linear checks the kernels and the quant benchmark the engine")
def test_quantized_engine_kernels_match_references(quantization: str | None, kv_cache_dtype: str,
                                                   rel_tol: float) -> None:
    prompt = list(range(300, 327))  # 27 tokens: a partial block at each boundary
    kernel_runner = runner("triton", quantization, kv_cache_dtype)
    reference_runner = runner("torch", quantization, kv_cache_dtype)
    if quantization is not None:
        linears = [m for m in kernel_runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 4 * 2 and all(m.backend == "triton" for m in linears)
    with torch.inference_mode():
        kernel_logits = logits_of_steps(kernel_runner, prompt)
        reference_logits = logits_of_steps(reference_runner, prompt)
    if kv_cache_dtype == "fp8":
        assert kernel_runner.kv_cache.tensor.dtype == torch.float8_e4m3fn
    scale = reference_logits.abs().max()
    assert (kernel_logits - reference_logits).abs().max() <= rel_tol * scale
    if kv_cache_dtype == "fp8":  # and both near the unquantized cache's logits (e4m3 keeps 3 mantissa bits)
        with torch.inference_mode():
            full_precision = logits_of_steps(runner("torch", quantization, "auto"), prompt)
        assert (reference_logits - full_precision).abs().max() <= 0.05 * scale  # measured ~0.01

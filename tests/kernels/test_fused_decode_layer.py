"""The fused decode layer (kernels.ops fusions) against the same layer unfused, on the Triton path (Triton's
interpreter on the CPU): one decoder layer's outputs and KV pages, and the engine's greedy tokens and pages over
chunked prefill, mixed and decode steps, fp8 KV cache and the prefill role's mirrored store included."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.attention import AttentionMetadata
from tandem.engine.engine import Engine
from tandem.engine.model import LlamaDecoderLayer
from tandem.engine.request import KVMirror, RequestStatus
from tandem.engine.rope import cos_sin_cache
from tandem.engine.runner import ModelRunner
from tandem.kernels import Ops, get_ops
from tandem.kernels.fp8_kv import FP8_KV_DTYPE
from tandem.kernels.ops import FUSIONS, OPT_IN_FUSIONS, parse_fusions
from tandem.models import load_model_config

pytestmark = pytest.mark.usefixtures("needs_triton")

PARTIAL = ["none", *FUSIONS]  # every fusion alone, and none, against all of them
# The layer test also takes the opt-in combine in the split kernel (the engine's steps on the CPU never split).
LAYER_VARIANTS = [*PARTIAL, *(f"all+{name}" for name in OPT_IN_FUSIONS)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t


# -- one layer ---------------------------------------------------------------------------------------------------
@functools.cache
def _layer_step(ops: Ops, is_fp8: bool, is_prefill: bool, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer (seeded weights) over a random cache: 3 decode tokens, or a decode token beside a
    5-token chunk at position 0 (mixed step). Returns its hidden output, residual and the [2, N, B, Hkv, D] pages
    (cached: the fused and the reference runs serve every variant)."""
    config = load_model_config("dummy:tiny", fetch=False)
    torch.manual_seed(1)
    with torch.device(device):
        layer = LlamaDecoderLayer(config, ops, 0).eval()
        for p in layer.parameters():  # norms too: a unit weight would hide a mixed-up one
            p.data.normal_(0.0, 0.3)
    num_blocks, block_size, hkv, d = 8, 4, config.num_key_value_heads, config.head_dim
    pages = torch.randn(2, num_blocks, block_size, hkv, d, device=device)
    attn = layer.self_attn
    if is_fp8:
        scales = torch.rand(2, hkv, device=device) * 0.02 + 0.01
        pages = (pages / 4).to(FP8_KV_DTYPE)
        attn.k_scale, attn.v_scale = scales[0], scales[1]
    num_decode = 1 if is_prefill else 3
    chunk = 5 if is_prefill else 0
    num_tokens = num_decode + chunk
    block_tables = torch.tensor([[3, 6, 1], [0, 2, 7], [5, 4, 0]], dtype=torch.int32, device=device)[:num_decode]
    context_lens = torch.tensor([9, 5, 12], dtype=torch.int32, device=device)[:num_decode]
    # The decode tokens' own slots are their context's last position; the chunk goes to block 4 and 5.
    decode_slots = [int(block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                    for i, n in enumerate(context_lens.tolist())]
    chunk_slots = [4 * block_size + i for i in range(chunk)]
    slots = torch.tensor(decode_slots + chunk_slots, device=device)
    if not is_prefill:
        slots[1] = -1  # a CUDA graph's padding token: rotated, nothing stored
    positions = torch.tensor([n - 1 for n in context_lens.tolist()] + list(range(chunk)), device=device)
    meta = AttentionMetadata(is_prefill=is_prefill, slot_mapping=slots, num_decode_tokens=num_decode,
                             block_tables=block_tables, context_lens=context_lens, num_splits=2)
    if is_prefill:
        meta.cu_seqlens = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        meta.max_seqlen = chunk
    hidden = torch.randn(num_tokens, config.hidden_size, device=device)
    residual = torch.randn(num_tokens, config.hidden_size, device=device)
    cos_sin = cos_sin_cache(config.rope, d, 64, device)
    with torch.inference_mode():
        out, new_residual = layer(positions, hidden, residual, (pages[0], pages[1]), meta, cos_sin)
    return out, new_residual, pages


@pytest.mark.parametrize("is_prefill", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("is_fp8", [False, True], ids=["same_dtype", "fp8"])
@pytest.mark.parametrize("fusions", LAYER_VARIANTS)
def test_one_layer_fused_equals_unfused(fusions: str, is_fp8: bool, is_prefill: bool, device: torch.device) -> None:
    fused = _layer_step(get_ops("triton", "all"), is_fp8, is_prefill, device)
    partial = _layer_step(get_ops("triton", fusions), is_fp8, is_prefill, device)
    reference = _layer_step(get_ops("torch"), is_fp8, is_prefill, device)
    # The fused kernels do the unfused ones' arithmetic: outputs and every page byte, bit for bit.
    for a, b in zip(fused, partial, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    # And the references', within rounding (an e4m3 code may move one step on a last-bit difference).
    torch.testing.assert_close(fused[0], reference[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused[1], reference[1], atol=1e-4, rtol=1e-4)
    if is_fp8:
        torch.testing.assert_close(fused[2].float(), reference[2].float(), atol=1e-6, rtol=2.0**-3)
    else:
        torch.testing.assert_close(fused[2], reference[2], atol=1e-4, rtol=1e-4)


# -- the engine --------------------------------------------------------------------------------------------------
def _engine(fusions: str, kv_cache_dtype: str = "auto") -> Engine:
    config = EngineConfig(model=load_model_config("dummy:tiny", fetch=False),
                          cache=CacheConfig(block_size=8, num_blocks=32, kv_cache_dtype=kv_cache_dtype),
                          # 16 tokens a step: the 23-token prompt takes two chunks, the second beside a decode token.
                          scheduler=SchedulerConfig(max_model_len=96, max_num_batched_tokens=16))
    ops = get_ops("triton", fusions)
    engine = Engine(config, ModelRunner(config, ops=ops))
    assert engine.runner.ops.fusions == parse_fusions(fusions)
    return engine


def _greedy(engine: Engine) -> tuple[list[list[int]], int]:
    """The tokens of two greedy requests (4 and 23 prompt tokens), and the number of steps taken."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate([[5, 9, 200, 31], list(range(100, 123))])]
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
    return [r.output_token_ids for r in requests], num_steps


@pytest.mark.parametrize("fusions", PARTIAL)
def test_engine_tokens_and_pages_fused_equal_unfused(fusions: str) -> None:
    fused, partial = _engine("all"), _engine(fusions)
    assert _greedy(fused) == _greedy(partial)
    assert torch.equal(fused.runner.kv_cache.tensor, partial.runner.kv_cache.tensor)


def test_engine_fp8_kv_and_mirror_fused_equal_unfused() -> None:
    """fp8 pages with per-head scales, and the prefill role's second store into a peer pool: the same bytes
    fused and unfused, and the peer's pages are the local ones."""
    pages = []
    for fusions in ("all", "none"):
        engine = _engine(fusions, kv_cache_dtype="fp8")
        cache = engine.runner.kv_cache
        assert cache.scales is not None
        cache.scales.copy_(torch.linspace(0.002, 0.02, cache.scales.numel()).reshape(cache.scales.shape))
        peer = torch.full_like(cache.tensor.view(torch.uint8), 0x7F).view(FP8_KV_DTYPE)  # 0x7f: NaN in e4m3
        layers = [(peer[i, 0], peer[i, 1]) for i in range(peer.shape[0])]
        targets = [20, 3, 11]
        request = engine.add_request("m", list(range(300, 319)), SamplingParams(max_tokens=1, seed=0),
                                     prefill_only=True, kv_mirror=KVMirror(layers, targets))
        while request.status != RequestStatus.PREFILLED:  # two chunks of the 16-token budget
            engine.step()
        for layer in range(peer.shape[0]):
            k, v = engine.read_pages(request, layer)
            for mirrored, local in ((peer[layer, 0], k), (peer[layer, 1], v)):
                got = mirrored.view(torch.uint8)[torch.tensor(targets)].flatten(0, 1)[:19]
                assert torch.equal(got, local.view(torch.uint8).flatten(0, 1)[:19])
        pages.append(torch.stack([torch.cat(engine.read_pages(request, i)) for i in range(peer.shape[0])]))
    assert torch.equal(pages[0].view(torch.uint8), pages[1].view(torch.uint8))


def test_the_fused_kernel_is_what_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """With rope_store on, the model launches rope_store_kv and neither rotary_embedding nor store_kv (no mirror);
    with it off, both of those and not the fused kernel."""
    import tandem.kernels.ops as ops_module

    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        fn = getattr(ops_module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for name in ("rope_store_kv_triton", "rotary_embedding_triton", "store_kv_triton"):
        monkeypatch.setattr(ops_module, name, counted(name))
    ops_module._triton_ops.cache_clear()  # bundles are built from the module's names when first asked for
    try:
        for fusions, expected in (("rope_store", {"rope_store_kv_triton"}),
                                  ("add_norm", {"rotary_embedding_triton", "store_kv_triton"})):
            calls.clear()
            engine = _engine(fusions)
            _, num_steps = _greedy(engine)
            assert set(calls) == expected
            assert len(calls) == engine.config.model.num_hidden_layers * num_steps * len(expected)
    finally:
        ops_module._triton_ops.cache_clear()

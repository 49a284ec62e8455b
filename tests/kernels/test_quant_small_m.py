"""The small-M (decode) path of the quantized linears (`tandem.kernels.quant_small_m`): launch settings, the
GEMV / skinny GEMM against the dequantized matmul, the split-K reduction, and `quant_linear`'s dispatch by M.

Run: `TRITON_INTERPRET=1 pytest tests/kernels/test_quant_small_m.py` (kernels through the interpreter on the CPU).
"""

from __future__ import annotations

import pytest
import torch

import tandem.kernels.fp8_linear as fp8_linear_module
import tandem.kernels.int8_linear as int8_linear_module
from tandem.kernels.fp8_linear import (
    fp8_linear_ref,
    fp8_linear_torch,
    fp8_linear_triton,
    fp8_weight_only_ref,
    quantize_fp8_weight,
)
from tandem.kernels.int8_linear import (
    Int8LinearConfig,
    int8_launch_config,
    int8_linear_ref,
    int8_linear_triton,
    quantize_int8_weight,
)
from tandem.kernels.quant_common import (
    INT8_BITS_DEFAULT,
    INT8_BITS_ENV,
    SMALL_M_INT8_BITS_DEFAULT,
    int8_bits_default,
)
from tandem.kernels.quant_linear import QuantWeight, linear_function
from tandem.kernels.quant_small_m import (
    M1_BLOCK_N_ENV,
    SMALL_M_ENV,
    X_TILE_ENV,
    SmallMConfig,
    SmallMWorkspace,
    small_m_k_per_split,
    small_m_launch_config,
    small_m_linear_triton,
    small_m_settings,
    use_small_m,
)
from tests.kernels.test_quant_linear import rel_err

# Llama-3.1-8B projections (N, K): qkv, o, gate_up, down.
LLAMA_8B_PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.fixture
def small_m_env(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set the small-M switches for one test: `small_m_env(NAME="value", ...)`; re-read after, and at teardown."""
    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        small_m_settings.cache_clear()
    yield set_env
    monkeypatch.undo()
    small_m_settings.cache_clear()


def test_small_m_launch_config_8b_shapes() -> None:
    # M = 1 on the CUDA cores: 16-row tiles, K split towards 4 programs per SM (132 SMs), fused reduce.
    splits = {name: small_m_launch_config(1, n, k, 0, 132).split_k for name, (n, k) in LLAMA_8B_PROJECTIONS.items()}
    assert splits == {"qkv": 2, "o": 3, "gate_up": 1, "down": 3}
    cfg = small_m_launch_config(1, 4096, 4096, 0, 132)
    assert cfg == SmallMConfig(use_dot=False, block_m=1, block_n=16, block_k=256, split_k=3, num_warps=4,
                               num_stages=3, fused_reduce=True)
    # The earlier 32-row tile, still selectable ($TANDEM_QUANT_M1_BLOCK_N=32): twice the rows, more K splits.
    wide = {name: small_m_launch_config(1, n, k, 0, 132, m1_block_n=32).split_k
            for name, (n, k) in LLAMA_8B_PROJECTIONS.items()}
    assert wide == {"qkv": 3, "o": 4, "gate_up": 1, "down": 5}
    assert not small_m_launch_config(1, 28672, 4096, 0, 132).fused_reduce  # one split: nothing to reduce
    # M = 16 on the tensor cores: 16 x 64 x 128, ~2 programs per SM.
    cfg = small_m_launch_config(16, 4096, 4096, 0, 132)
    assert (cfg.use_dot, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k) == (True, 16, 64, 128, 5)
    splits = {name: small_m_launch_config(16, n, k, 0, 132).split_k for name, (n, k) in LLAMA_8B_PROJECTIONS.items()}
    assert splits == {"qkv": 3, "o": 5, "gate_up": 1, "down": 5}
    # The switches are arguments: the function is pure.
    assert small_m_launch_config(4, 4096, 4096, 0, 132, fma_max_m=4).use_dot is False
    assert small_m_launch_config(1, 4096, 4096, 0, 132, fma_max_m=0).use_dot is True
    assert small_m_launch_config(1, 4096, 4096, 0, 132, fused_reduce=False).fused_reduce is False
    assert small_m_launch_config(1, 4096, 4096, 0, 132, programs_per_sm=8).split_k == 4  # 5 wanted, whole K tiles: 4
    assert small_m_launch_config(1, 4096, 4096, 0, 132) == small_m_launch_config(1, 4096, 4096, 0, 132)
    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"m={bad}"):
            small_m_launch_config(bad, 64, 64, 0, 4)


@pytest.mark.parametrize("fma_max_m", [0, 1, 16])
def test_small_m_launch_config_invariants(fma_max_m: int) -> None:
    for m in (1, 2, 3, 5, 16):
        for n in (7, 4096, 6144, 28672):
            for k in (40, 300, 4096, 14336):
                for group_size in (0, 16, 48, 128):
                    if group_size and k % group_size:
                        continue
                    cfg = small_m_launch_config(m, n, k, group_size, 132, fma_max_m=fma_max_m)
                    assert cfg.use_dot == (m > fma_max_m)
                    assert cfg.block_m >= m and (not cfg.use_dot or cfg.block_m == 16)
                    assert cfg.block_m * cfg.block_n * cfg.block_k <= 16 * 64 * 128
                    assert 1 <= cfg.split_k <= 32
                    per_split = small_m_k_per_split(k, cfg.block_k, cfg.split_k)
                    assert per_split % cfg.block_k == 0 and -(-k // per_split) == cfg.split_k
                    assert (cfg.split_k - 1) * per_split < k  # no empty slice
                    assert not group_size or group_size % cfg.block_k == 0
                    assert cfg.fused_reduce == (cfg.split_k > 1)


def test_small_m_settings_from_env(small_m_env) -> None:  # type: ignore[no-untyped-def]
    small_m_env()
    # Unset: the measured defaults, fp8 up to M = 4, int8 at M = 1.
    assert small_m_settings().max_m is None and use_small_m(1, kind="fp8") and use_small_m(4, kind="fp8")
    assert not use_small_m(5, kind="fp8") and use_small_m(1, kind="int8") and not use_small_m(2, kind="int8")
    assert not use_small_m(0) and not use_small_m(1, small_m=False) and use_small_m(16, small_m=True)
    assert use_small_m(16, small_m=True, kind="int8")
    small_m_env(**{SMALL_M_ENV: "16"})
    assert use_small_m(16, kind="int8") and use_small_m(16, kind="fp8") and not use_small_m(17)
    small_m_env(**{SMALL_M_ENV: "0"})
    assert not use_small_m(1) and use_small_m(1, small_m=True)
    assert small_m_settings().x_tile and small_m_settings().m1_block_n == 16  # the measured defaults
    small_m_env(**{SMALL_M_ENV: "4", "TANDEM_QUANT_FMA_MAX_M": "2", "TANDEM_QUANT_FUSED_REDUCE": "0",
                   "TANDEM_QUANT_PROGRAMS_PER_SM": "6", X_TILE_ENV: "0", M1_BLOCK_N_ENV: "32"})
    assert small_m_settings() == (4, 2, False, 6, False, 32) and use_small_m(4) and not use_small_m(5)
    small_m_env(**{M1_BLOCK_N_ENV: "24"})
    with pytest.raises(ValueError, match="TANDEM_QUANT_M1_BLOCK_N=24 must be 16, 32 or 64"):
        small_m_settings()
    small_m_env(**{SMALL_M_ENV: "32"})
    with pytest.raises(ValueError, match="TANDEM_QUANT_SMALL_M=32"):
        small_m_settings()
    small_m_env(**{SMALL_M_ENV: "yes"})
    with pytest.raises(ValueError, match="not an integer"):
        small_m_settings()


def _small_m_case(kind: str, m: int, n: int, k: int, group_size: int | None, has_bias: bool,
                  device: torch.device) -> tuple[torch.Tensor, QuantWeight, torch.Tensor | None, torch.Tensor]:
    """x, the quantized weight, bias, and the float64 product with the dequantized weight."""
    x = torch.randn(m, k, device=device)
    qw = QuantWeight.quantize(torch.randn(n, k, device=device) / k**0.5, kind, group_size=group_size,
                              clip_search=False)
    bias = torch.randn(n, device=device) if has_bias else None
    exact = x.double() @ qw.dequantize().double().T
    return x, qw, bias, exact if bias is None else exact + bias.double()


# (kind, M, N, K, group size): M = 1, 3, 16; N and K not multiples of any block; group-wise int8 scales
# (48: K tiles of 16; 64 with a ragged N).
SMALL_M_CASES = [
    ("int8", 1, 7, 40, None), ("int8", 3, 33, 200, None), ("int8", 16, 65, 300, None),
    ("int8", 1, 33, 192, 64), ("int8", 3, 19, 144, 48), ("int8", 16, 40, 256, 32),
    ("fp8", 1, 7, 40, None), ("fp8", 3, 33, 200, None), ("fp8", 16, 65, 300, None),
]


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("variant", ["fma", "dot"])
@pytest.mark.parametrize("case", SMALL_M_CASES, ids=lambda c: "-".join(map(str, c)))
def test_small_m_kernel_matches_dequantized_matmul(case: tuple[str, int, int, int, int | None], variant: str,
                                                   device: torch.device) -> None:
    kind, m, n, k, group_size = case
    x, qw, bias, exact = _small_m_case(kind, m, n, k, group_size, True, device)
    # 8 programs per SM on 4 "SMs": the small shapes split K too (fused reduce).
    cfg = small_m_launch_config(m, n, k, group_size or 0, 4, fma_max_m=16 if variant == "fma" else 0,
                                programs_per_sm=8)
    out = small_m_linear_triton(x, qw.qweight, qw.scales, bias, config=cfg)
    assert out.dtype == x.dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=1e-4)
    ref = int8_linear_ref(x, qw.qweight, qw.scales, bias) if kind == "int8" else \
        fp8_weight_only_ref(x, qw.qweight, qw.scales, bias)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("case", [c for c in SMALL_M_CASES if c[1] == 1], ids=lambda c: "-".join(map(str, c)))
def test_x_tile_gives_the_same_products(case: tuple[str, int, int, int, int | None], device: torch.device) -> None:
    """M = 1's activations loaded as a tile in the weight's layout (`x_tile`, the default): the same products, as
    close to the exact sums as the row load's; in the interpreter the same bits. Not on hardware: the compiler may
    reduce the tile in another order (on an H100, other last bits for K = 40, one masked tile; the same bits for
    K = 192 in groups of 64). Only the CUDA-core M = 1 variant takes it."""
    kind, m, n, k, group_size = case
    x, qw, bias, exact = _small_m_case(kind, m, n, k, group_size, True, device)
    cfg = small_m_launch_config(m, n, k, group_size or 0, 4, programs_per_sm=8)
    tiled = small_m_launch_config(m, n, k, group_size or 0, 4, programs_per_sm=8, x_tile=True)
    assert tiled.x_tile and tiled._replace(x_tile=False) == cfg
    assert not small_m_launch_config(4, n, k, group_size or 0, 4, x_tile=True).x_tile  # tensor cores: no
    out = small_m_linear_triton(x, qw.qweight, qw.scales, bias, config=cfg)
    got = small_m_linear_triton(x, qw.qweight, qw.scales, bias, config=tiled)
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-4)
    if device.type == "cuda":
        torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(got, out)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_small_m_split_k_reduce(kind: str, fused: bool, device: torch.device) -> None:
    # 3 splits of 2 + 2 + 1 K tiles (ragged last tile): the last program of each N tile sums them, and resets its
    # counter, so a second launch on the same workspace is right and bit-identical (fixed summation order).
    m, n, k = 2, 50, 300
    x, qw, bias, exact = _small_m_case(kind, m, n, k, None, True, device)
    cfg = SmallMConfig(use_dot=False, block_m=2, block_n=16, block_k=64, split_k=3, num_warps=4, num_stages=2,
                       fused_reduce=fused)
    workspace = SmallMWorkspace()
    first = small_m_linear_triton(x, qw.qweight, qw.scales, bias, config=cfg, workspace=workspace)
    second = small_m_linear_triton(x, qw.qweight, qw.scales, bias, config=cfg, workspace=workspace)
    torch.testing.assert_close(first.double(), exact, atol=1e-4, rtol=1e-4)
    assert torch.equal(first, second)
    counters = workspace.counters(device, 1)
    assert counters is not None and not counters.any()  # zero again after the launches


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's bf16 loads are not like hardware "
                    "(the GEMM's too): bf16 runs on a GPU")
def test_small_m_bf16_activations(device: torch.device) -> None:
    # bf16 x (the GPU engine's dtype), fp32 accumulation: only the output's rounding to bf16 differs; both
    # variants (CUDA cores at M = 1, 2 with fma_max_m 2; tensor cores at 2 by default).
    for kind in ("int8", "fp8"):
        for m, fma_max_m in ((1, 1), (2, 2), (2, 1), (16, 1)):
            x, qw, bias, _ = _small_m_case(kind, m, 300, 4096 + 96, None, True, device)
            xb = x.bfloat16()
            cfg = small_m_launch_config(m, 300, 4096 + 96, 0, 132, fma_max_m=fma_max_m)
            out = small_m_linear_triton(xb, qw.qweight, qw.scales, bias, config=cfg)
            exact = xb.double() @ qw.dequantize().double().T + bias.double()  # type: ignore[union-attr]
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1e-2)


@pytest.mark.usefixtures("needs_triton")
def test_dispatch_picks_small_m_by_m(small_m_env, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                     device: torch.device) -> None:
    calls: list[int] = []
    real = int8_linear_module.small_m_linear_triton

    def spy(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(int8_linear_module, "small_m_linear_triton", spy)
    monkeypatch.setattr(fp8_linear_module, "small_m_linear_triton", spy)
    small_m_env(**{SMALL_M_ENV: "16"})  # both kinds up to 16 (the defaults differ per kind: the settings test)
    w = torch.randn(24, 64, device=device)
    qi, si = quantize_int8_weight(w)
    qf, sf = quantize_fp8_weight(w)
    for m in (1, 16, 17):
        int8_linear_triton(torch.randn(m, 64, device=device), qi, si)
        fp8_linear_triton(torch.randn(m, 64, device=device), qf, sf)
    assert calls == [1, 1, 16, 16]
    calls.clear()
    x = torch.randn(3, 64, device=device)
    int8_linear_triton(x, qi, si, config=int8_launch_config(3, 24, 64, 0, 4))  # a GEMM config: the GEMM
    int8_linear_triton(x, qi, si, small_m=False)
    assert calls == []
    # fp8 at small M is weight-only (no activation rounding): closer to the exact product than W8A8.
    exact = x.double() @ w.double().T
    weight_only, w8a8 = fp8_linear_triton(x, qf, sf), fp8_linear_triton(x, qf, sf, small_m=False)
    assert calls == [3]
    assert rel_err(weight_only, exact) < rel_err(w8a8, exact)
    torch.testing.assert_close(fp8_linear_torch(x, qf, sf), weight_only, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fp8_linear_torch(x.repeat(6, 1), qf, sf), fp8_linear_ref(x.repeat(6, 1), qf, sf))
    assert linear_function("fp8", "torch") is fp8_linear_torch
    # The switch off: the GEMMs everywhere, for the torch backend's fp8 too.
    calls.clear()
    small_m_env(**{SMALL_M_ENV: "0"})
    int8_linear_triton(x, qi, si)
    fp8_linear_triton(x, qf, sf)
    assert calls == []
    torch.testing.assert_close(fp8_linear_torch(x, qf, sf), fp8_linear_ref(x, qf, sf))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a tiny fp32 engine in Triton's interpreter")
def test_engine_decode_takes_the_small_m_path(small_m_env, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.common.sampling_params import SamplingParams
    from tandem.engine.quantization import QuantizedLinear
    from tandem.engine.request import Request
    from tandem.engine.runner import ModelRunner
    from tandem.kernels import get_ops
    from tandem.models import load_model_config

    small_m_env(**{SMALL_M_ENV: "16"})  # int8 up to M = 16 (its default: M = 1)
    calls: list[tuple[int, bool]] = []
    real = int8_linear_module.small_m_linear_triton

    def spy(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append((x.shape[0], isinstance(kwargs.get("workspace"), SmallMWorkspace)))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(int8_linear_module, "small_m_linear_triton", spy)
    model = replace(load_model_config("dummy:tiny", fetch=False), quantization="int8")
    config = EngineConfig(model=model, cache=CacheConfig(block_size=8, num_blocks=8),
                          scheduler=SchedulerConfig(max_model_len=64))
    runner = ModelRunner(config, ops=get_ops("triton"))
    linears = [mod for mod in runner.model.modules() if isinstance(mod, QuantizedLinear)]
    request = Request(req_id="q", prompt_token_ids=list(range(300, 320)), params=SamplingParams(max_tokens=2), seed=0)
    request.block_ids = [2, 5, 0]
    with torch.inference_mode():
        runner.chunk_logits([(request, 0, 20)], [1])  # a 20-token prefill: the GEMM
        assert calls == []
        request.output_token_ids.append(1)
        request.num_computed_tokens = 20
        runner.decode_logits([request])  # one token: every projection on the small-M kernel, with its workspace
    assert calls == [(1, True)] * len(linears)




@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("kernel", ["small-m-fma", "small-m-dot", "large-m"])
def test_int8_bits_conversion_matches_i2f_bitwise(kernel: str, device: torch.device) -> None:
    # Every int8 value (-128 .. 127) in the weight, a ragged K (masked lanes load 0): the integer-op conversion
    # gives the same outputs, bit for bit, as the conversion instruction, and both the dequantized product.
    n, k = 9, 40
    qweight = (torch.arange(n * k, device=device) % 256 - 128).to(torch.int8).reshape(n, k)
    scales = torch.rand(n, device=device) + 0.5
    m = 1 if kernel == "small-m-fma" else 3
    x = torch.randn(m, k, device=device)
    outs = []
    for bits in (False, True):
        if kernel == "large-m":
            cfg: SmallMConfig | Int8LinearConfig = int8_launch_config(m, n, k, 0, 4, int8_bits=bits)
        else:
            cfg = small_m_launch_config(m, n, k, 0, 4, fma_max_m=1 if kernel == "small-m-fma" else 0,
                                        int8_bits=bits)
        assert cfg.int8_bits is bits
        outs.append(int8_linear_triton(x, qweight, scales, config=cfg))
    assert torch.equal(outs[0], outs[1])
    exact = x.double() @ (qweight.double() * scales.double()[:, None]).T
    torch.testing.assert_close(outs[1].double(), exact, atol=1e-4, rtol=1e-4)


def test_int8_bits_default_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        for raw, expected in (("", INT8_BITS_DEFAULT), ("1", True), ("0", False)):
            monkeypatch.setenv(INT8_BITS_ENV, raw)
            int8_bits_default.cache_clear()
            assert int8_bits_default() is expected
            # The small-M GEMV's own default, overridden by the variable in both directions.
            small_m_expected = SMALL_M_INT8_BITS_DEFAULT if raw == "" else expected
            assert int8_bits_default(SMALL_M_INT8_BITS_DEFAULT) is small_m_expected
        monkeypatch.setenv(INT8_BITS_ENV, "yes")
        int8_bits_default.cache_clear()
        with pytest.raises(ValueError, match=INT8_BITS_ENV):
            int8_bits_default()
    finally:
        monkeypatch.undo()
        int8_bits_default.cache_clear()

"""Frozen configuration dataclasses, one per concern, built once at the edge and passed down.

The engine core never reads the environment: the CLI and services build these from flags/env. Plain
values only (no torch): the gateway imports them too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def env_number(name: str, default: float, kind: type[int] | type[float] = float) -> float:
    """A number from the environment variable `name` (unset or empty: `default`); anything but a finite number
    >= 0 of `kind` is a ConfigError naming the variable."""
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{name}={value!r} must be a finite number, at least 0")
    return number


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ConfigError(f"rope_type: unsupported RoPE type {self.rope_type!r} (default, llama3)")
        if self.theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.theta}")


# Weight quantization (`ModelConfig.quantization`): "int8" weight-only (per-output-channel scales; the GEMMs
# dequantize in the kernel), "fp8" e4m3 weights (per-channel scales) with dynamic per-token e4m3 activations.
# Embeddings and the output head stay unquantized. See tandem.engine.quantization.
QUANTIZATION_METHODS = ("int8", "fp8")
# KV cache dtypes (`CacheConfig.kv_cache_dtype`): "auto" the model's dtype, "fp8" float8_e4m3fn pages with static
# per-(layer, kv head) scales beside them (see tandem.engine.kv_cache).
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and semantics of a Llama-family decoder; parameter names follow HF's config."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Local HF folder with the weights (safetensors); None means random ("dummy") weights.
    weights_path: str | None = None
    # Folder holding tokenizer.json / tokenizer_config.json; None if the model has no tokenizer.
    tokenizer_path: str | None = None
    # Seed of the random weights of a dummy model: every process builds the same weights.
    dummy_seed: int = 0
    # Weight quantization applied at load (`QUANTIZATION_METHODS`; None: the checkpoint's dtype). It changes what
    # the model computes (its K/V too), so it is part of the fingerprint: int8 and bf16 workers never share pages.
    quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, "
                              f"got {self.quantization!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def fingerprint(self) -> str:
        """Identifies the weights and shapes: two workers may share KV pages only if these match."""
        values = asdict(self) | {"name": None, "weights_path": None, "tokenizer_path": None}
        if self.quantization is None:
            del values["quantization"]  # unquantized models keep the fingerprints they had before the field existed
        blob = json.dumps(values, sort_keys=True, default=str)
        if self.weights_path is not None:
            blob += self.name
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` fixed-size blocks of `block_size` tokens."""

    block_size: int = 16
    # Explicit pool size in blocks; None sizes it from memory (gpu_memory_fraction on CUDA,
    # cpu_kv_bytes on the CPU).
    num_blocks: int | None = None
    gpu_memory_fraction: float = 0.85
    cpu_kv_bytes: int = 512 * 1024 * 1024
    # Full blocks stay cached under a hash of their tokens (and everything before them) after their request
    # ends; a later prompt that starts the same way reuses them instead of computing them again.
    enable_prefix_caching: bool = True
    # "auto": pages in the model's dtype; "fp8": float8_e4m3fn pages (half of bf16's bytes: twice the blocks in the
    # same memory), the layout's dtype then, so fp8 and bf16 workers are never paired.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


# Default token budget of a step with chunked prefill, by device. On an H200 with Llama-3.1-8B an eager step with
# prompt tokens costs ~23 ms whether it holds 512 or 1,024 of them (`benchmarks/results/h200-2026-12-01/
# step-trace-*.json`: below ~1k tokens the step is bound by its fixed cost, not the GPU's compute), so 512-token
# chunks doubled the TTFT of 1,024-token prompts at 2 req/s (97 against 33 ms); 2,048 takes such prompts in one step
# and still cuts a 32k-token prompt into ~45 ms steps. On the 2-core CPU, see docs/architecture.md ("Chunked
# prefill") for SmolLM2-135M.
DEFAULT_BATCHED_TOKENS = {"cuda": 2048, "cpu": 256}
# A prefill worker's on a GPU: no decode tokens share its steps, so its budget only bounds activation memory and
# batches concurrent prompts (a 32k prompt still runs in 4 chunks).
PREFILL_BATCHED_TOKENS_CUDA = 8192
# ... but one that shares its GPU with a decode worker (`tandem up` puts every worker on one device; through MPS by
# default) takes the served default: while each of its steps runs, its kernels take SMs from decode's. On an H100
# (llama-3.1-8b, 1,024/256 tokens, 128 requests at 2/8/16/32/48 req/s; benchmarks/results/h100-2026-12-07c/
# 2-serve14 against h100-2026-12-07d/2-gemv18-serve14b), 8,192 -> 2,048 took decode's ITL p99 from
# 19.0/29.7/42.1/76.2/115.9 ms to 22.1/28.1/35.3/49.2/47.5 and the goodput at 48 req/s from 2.87 to 3.20 (0.79 ->
# 0.88 of colocated's), at the price of 32 req/s's (13.47 -> 10.55, colocated's 10.51).
SHARED_GPU_PREFILL_BATCHED_TOKENS = DEFAULT_BATCHED_TOKENS["cuda"]
# The offline `LLM`'s on a GPU, where nobody waits between tokens: throughput wants big steps (H200, llama-3.1-8b,
# 256 x (1,024, 128): 2,494 tok/s at 512, 3,608 at 16,384, 3,659 with whole prompts). Served workers keep the
# smaller budget above, which bounds the inter-token latency of the requests a chunk shares its step with.
OFFLINE_BATCHED_TOKENS_CUDA = 16384
# Without chunked prefill a whole prompt must fit one step.
DEFAULT_BATCHED_TOKENS_UNCHUNKED = 8192
# `SchedulerConfig.prompt_tokens_while_decoding`, prompt tokens a step may carry beside decode tokens while the queue
# is short, is 0 (no cap) by default on every device. Measured on an H200 (llama-3.1-8b, 1,024/256 tokens, 2-48
# req/s; benchmarks/results/h200-2026-12-02d/): a cap of 512 holds ITL p99 within 2.0-2.4x TPOT p50 at 2-16 req/s
# (the defaults: 2.1-4.0x) at equal goodput, but costs 35% of the goodput at 32 req/s: an option for latency-bound
# deployments at moderate load, not the default.
# The cap is lifted while more prompt tokens wait than this many capped steps would clear (throughput first when the
# queue builds).
BACKLOG_STEPS = 8
# max_model_len's default cap (the model's context may be far longer): CUDA graphs size their block tables and
# the decode attention its splits from it. A larger value can always be given.
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # Token budget of one step (decode tokens + prompt chunks); None: the device's default (DEFAULT_BATCHED_TOKENS,
    # or DEFAULT_BATCHED_TOKENS_UNCHUNKED without chunked prefill). Any budget >= 1 works with chunked prefill.
    max_num_batched_tokens: int | None = None
    # Longest prompt + output a request may have; None means the model's context, capped at DEFAULT_MAX_MODEL_LEN
    # (and, without chunked prefill, at the token budget: a prompt is then prefilled in one step).
    max_model_len: int | None = None
    # Long prompts are computed in chunks, in steps shared with the running requests' decode tokens.
    enable_chunked_prefill: bool = True
    # With chunked prefill: a step that carries decode tokens computes at most this many prompt tokens, unless more
    # than BACKLOG_STEPS times as many wait (then the whole budget); 0: no cap (the default, see above).
    prompt_tokens_while_decoding: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prompt_tokens_while_decoding < 0:
            raise ConfigError(f"prompt_tokens_while_decoding must be >= 0 (0: no cap), got "
                              f"{self.prompt_tokens_while_decoding}")

    def resolved(self, device: str) -> SchedulerConfig:
        """With the token budget chosen for `device` when none was given."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=default_batched_tokens(device, self.enable_chunked_prefill))


def default_batched_tokens(device: str, enable_chunked_prefill: bool = True, role: str = "decode") -> int:
    """A step's token budget when none is given: by device, and larger on a GPU prefill worker."""
    if not enable_chunked_prefill:
        return DEFAULT_BATCHED_TOKENS_UNCHUNKED
    if device == "cpu":
        return DEFAULT_BATCHED_TOKENS["cpu"]
    return PREFILL_BATCHED_TOKENS_CUDA if role == "prefill" else DEFAULT_BATCHED_TOKENS["cuda"]


# The compute dtypes a worker may run with (`EngineConfig.dtype`).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# Sizes in bytes of the dtypes a KV layout may have: the compute dtypes and the fp8 cache's.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    # "auto": float32 on CPU, bfloat16 on CUDA.
    dtype: str = "auto"
    # Fused Triton kernels where the device supports them; references otherwise.
    use_triton: bool = True
    # CUDA graphs for decode steps (ignored on CPU).
    use_cuda_graphs: bool = True
    # With use_cuda_graphs: steps with prompt tokens replay captured pieces around eager attentions (PiecewiseGraphs).
    piecewise_cuda_graphs: bool = True
    # Launch consecutive pure decode steps one ahead (the next step's inputs are built while the GPU runs this one).
    # None: on for CUDA, off on the CPU (a launch there computes the whole step, so it would only hold tokens back
    # a step); resolved to a bool here (docs/architecture.md, "Async scheduling").
    async_scheduling: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be cpu or cuda[:N], got {self.device!r}")
        # The budget is resolved for the device here, once: everything after reads a number.
        object.__setattr__(self, "scheduler", self.scheduler.resolved(self.device))
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", self.device.startswith("cuda"))
        if self.max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({self.max_model_len}) exceeds the model's context "
                f"({self.model.max_position_embeddings})"
            )
        if not self.scheduler.enable_chunked_prefill and self.budget < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.budget}) must be >= max_model_len ({self.max_model_len}) without "
                "chunked prefill, so that any admissible prompt fits one step"
            )

    @property
    def budget(self) -> int:
        """The step's token budget (resolved for the device)."""
        assert self.scheduler.max_num_batched_tokens is not None
        return self.scheduler.max_num_batched_tokens

    @classmethod
    def create(cls, model: ModelConfig, *, device: str = "cpu", dtype: str = "auto", block_size: int = 16,
               num_kv_blocks: int | None = None, gpu_memory_fraction: float = 0.85, max_model_len: int | None = None,
               max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool = True,
               prompt_tokens_while_decoding: int | None = None,
               enable_prefix_caching: bool = True, use_triton: bool = True, use_cuda_graphs: bool = True,
               piecewise_cuda_graphs: bool = True, seed: int = 0, quantization: str | None = None,
               kv_cache_dtype: str = "auto", async_scheduling: bool | None = None) -> EngineConfig:
        """The one place flat settings (flags, `LLM(...)` keywords) become the nested config. `quantization` set
        replaces the model's (None keeps it: unquantized unless the ModelConfig says otherwise)."""
        if quantization is not None:
            model = replace(model, quantization=quantization)
        return cls(model=model,
                   cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                                     gpu_memory_fraction=gpu_memory_fraction,
                                     enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=max_model_len,
                                             enable_chunked_prefill=enable_chunked_prefill,
                                             prompt_tokens_while_decoding=prompt_tokens_while_decoding or 0),
                   device=device, dtype=dtype, use_triton=use_triton, use_cuda_graphs=use_cuda_graphs,
                   piecewise_cuda_graphs=piecewise_cuda_graphs, async_scheduling=async_scheduling, seed=seed)

    @property
    def max_model_len(self) -> int:
        if self.scheduler.max_model_len is not None:
            return self.scheduler.max_model_len
        limit = min(self.model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if not self.scheduler.enable_chunked_prefill:
            limit = min(limit, self.budget)
        return limit

    @property
    def resolved_dtype(self) -> str:
        """The dtype name the weights and activations use ("auto" resolved for the device); also the KV cache's
        unless kv_cache_dtype is "fp8" (`resolved_kv_dtype`)."""
        if self.dtype == "auto":
            return "float32" if self.device == "cpu" else "bfloat16"
        return self.dtype

    @property
    def resolved_kv_dtype(self) -> str:
        """The dtype name of the KV pages: the model's, or float8_e4m3fn with kv_cache_dtype="fp8"."""
        return "float8_e4m3fn" if self.cache.kv_cache_dtype == "fp8" else self.resolved_dtype

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(dtype=self.resolved_kv_dtype, block_size=self.cache.block_size,
                        num_layers=self.model.num_hidden_layers, num_kv_heads=self.model.num_key_value_heads,
                        head_dim=self.model.head_dim, model_fingerprint=self.model.fingerprint())


@dataclass(frozen=True)
class KVLayout:
    """What a page means: two workers may exchange pages only if their layouts are equal."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str

    def fingerprint(self) -> str:
        """Equal for exactly the workers that may exchange pages (same model, dtype and shapes)."""
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block's K (or V) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V across all layers."""
        return 2 * self.num_layers * self.block_bytes_per_layer

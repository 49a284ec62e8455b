"""The engine side that prefill and decode worker processes share: the engine on its thread, what a worker says
about itself (`Info`, its registry record, both with a summary of its prefix cache), and its pool and queue on
`/metrics`."""

from __future__ import annotations

import logging
import socket
import time
import uuid
import weakref

import torch

from tandem.common.config import EngineConfig
from tandem.engine.compile_watch import CompileWatch
from tandem.engine.engine import Engine
from tandem.engine.quantization import weight_bytes
from tandem.engine.runner import ModelRunner, select_ops
from tandem.engine.spec_decode import SpeculativeConfig
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.kv_ipc import gpu_uuid, transports_of
from tandem.serving.profiling import StepProfiler
from tandem.serving.registry import CACHE_VIEW_INTERVAL_S, MAX_SUMMARY_BLOCKS, CacheSummary, WorkerRecord
from tandem.serving.weight_ipc import map_weights
from tandem.serving.wire import layout_to_proto
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


def start_engine(config: EngineConfig, role: str, speculative: SpeculativeConfig | None = None,
                 shared_weights: worker_pb2.WeightsResponse | None = None) -> AsyncEngine:
    """The worker's engine, warmed up (kernels compiled before the worker reports healthy), on its own thread; its
    pool and queue read by `/metrics` at scrape time. A Triton compile after warm-up is logged and counted
    (`tandem_triton_compiles_total{phase="serving"}`): a request waited for it. `shared_weights`: a peer's weights
    to map instead of loading a copy (`tandem.serving.weight_ipc`)."""
    profiler = StepProfiler.from_env(role)  # a bad TANDEM_PROFILE_STEPS fails before the warm-up, not after
    watch = CompileWatch(lambda kernel: metrics.TRITON_COMPILES.labels("serving").inc())
    runner = None
    if shared_weights is not None:
        ops = select_ops(config)
        model = map_weights(shared_weights, config.model, ops, getattr(torch, config.resolved_dtype),
                            torch.device(config.device))
        runner = ModelRunner(config, ops, model=model)
        log.info("%s: mapped %d weight tensors of the worker beside it (%.2f GiB not loaded again)", role,
                 len(shared_weights.tensors), weight_bytes(model) / 2**30)
    core = Engine(config, runner, speculative=speculative)
    core.warm_up()
    metrics.TRITON_COMPILES.labels("startup").inc(watch.num_startup)
    watch.serving()
    engine = AsyncEngine(core, name=f"{role}-engine", profiler=profiler)
    pool = core.block_pool
    metrics.track_pool(lambda: pool.num_blocks, lambda: pool.num_free_blocks, lambda: core.scheduler.num_queued,
                       lambda: pool.num_cached_blocks,
                       lambda: (pool.prefix_cache_stats.num_query_tokens, pool.prefix_cache_stats.num_hit_tokens))
    return engine


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


# A worker takes its cache summary at most this often, however many gateways ask: four gateway processes probing
# every CACHE_VIEW_INTERVAL_S asked a decode worker 16 times a second, each time copying the pool's structures on the
# event loop (~100,000 blocks of llama-3.2-1b on an H200): 14% of that loop's samples at 56k tokens/s (py-spy,
# benchmarks/results/h200-2026-12-04b/3-rows), the GIL held throughout.
SUMMARY_MAX_AGE_S = CACHE_VIEW_INTERVAL_S
_summaries: weakref.WeakKeyDictionary[Engine, CacheSummary] = weakref.WeakKeyDictionary()


def cache_summary(engine: Engine, max_age_s: float = SUMMARY_MAX_AGE_S) -> CacheSummary | None:
    """What the engine's prefix cache holds, for routers (None when the cache is off); the last one taken if it is
    younger than `max_age_s` (its `taken_at` says when it was taken).

    Taken on the calling thread (the event loop), not the engine thread: `BlockPool.cached_hash_prefixes` is safe
    to call from there (it copies what it reads in single C-level calls) and takes ~1.5 ms for 65,536 blocks on the
    2-core CPU, while a trip to the engine thread would wait for the step in flight (hundreds of ms for a long
    prefill chunk on the CPU) and make `Info` async.
    """
    hash_key = engine.scheduler.prefix_key
    if hash_key is None:
        return None
    now = time.time()
    summary = _summaries.get(engine)
    if summary is not None and 0.0 <= now - summary.taken_at < max_age_s:
        return summary
    pool = engine.block_pool
    summary = _summaries[engine] = CacheSummary(
        block_size=engine.layout.block_size, hash_key=hash_key,
        block_hash_prefixes=pool.cached_hash_prefixes(MAX_SUMMARY_BLOCKS), num_cached_blocks=pool.num_cached_blocks,
        taken_at=now)
    return summary


def worker_info(async_engine: AsyncEngine, role: str, model_name: str) -> worker_pb2.WorkerInfo:
    """The `Info` answer of a prefill or decode worker (read from the event loop while the engine steps: counts and
    the cache summary may be a step behind)."""
    engine = async_engine.engine
    summary = cache_summary(engine)
    return worker_pb2.WorkerInfo(
        role=role, model=model_name, layout=layout_to_proto(engine.layout),
        num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
        queue_depth=engine.scheduler.num_queued, num_running=len(engine.scheduler.running),
        max_model_len=engine.max_model_len, vocab_size=engine.config.model.vocab_size,
        gpu_uuid=gpu_uuid(engine.runner.device), kv_transports=transports_of(engine.runner.device),
        prefix_cache=summary.to_proto() if summary is not None else None)


def worker_record(async_engine: AsyncEngine, role: str, model_name: str, worker_id: str,
                  address: str) -> WorkerRecord:
    """What this worker advertises in the registry (the heartbeat asks for it every `CACHE_VIEW_INTERVAL_S`)."""
    engine = async_engine.engine
    return WorkerRecord(role=role, address=address, model=model_name, fingerprint=engine.layout.fingerprint(),
                        num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
                        queue_depth=engine.scheduler.num_queued, worker_id=worker_id, updated_at=time.time(),
                        max_model_len=engine.max_model_len, vocab_size=engine.config.model.vocab_size,
                        cache=cache_summary(engine))

"""The engine side that prefill and decode worker processes share: the engine on its thread, what a worker says
about itself (`Info`, its registry record), and its pool and queue on `/metrics`."""

from __future__ import annotations

import socket
import time
import uuid

from tandem.common.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.kv_ipc import gpu_uuid, transports_of
from tandem.serving.registry import WorkerRecord
from tandem.serving.wire import layout_to_proto
from tandem.v1 import worker_pb2


def start_engine(config: EngineConfig, role: str) -> AsyncEngine:
    """The worker's engine, warmed up (kernels compiled before the worker reports healthy), on its own thread; its
    pool and queue read by `/metrics` at scrape time."""
    core = Engine(config)
    core.warm_up()
    engine = AsyncEngine(core, name=f"{role}-engine")
    metrics.track_pool(lambda: engine.engine.num_total_blocks, lambda: engine.engine.num_free_blocks,
                       lambda: engine.engine.scheduler.num_queued)
    return engine


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def worker_info(async_engine: AsyncEngine, role: str, model_name: str) -> worker_pb2.WorkerInfo:
    """The `Info` answer of a prefill or decode worker (read between steps; counts may lag by one)."""
    engine = async_engine.engine
    return worker_pb2.WorkerInfo(
        role=role, model=model_name, layout=layout_to_proto(engine.layout),
        num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
        queue_depth=engine.scheduler.num_queued, num_running=len(engine.scheduler.running),
        max_model_len=engine.max_model_len, vocab_size=engine.config.model.vocab_size,
        gpu_uuid=gpu_uuid(engine.runner.device), kv_transports=transports_of(engine.runner.device))


def worker_record(async_engine: AsyncEngine, role: str, model_name: str, worker_id: str,
                  address: str) -> WorkerRecord:
    """What this worker advertises in the registry."""
    engine = async_engine.engine
    return WorkerRecord(role=role, address=address, model=model_name, fingerprint=engine.layout.fingerprint(),
                        num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
                        queue_depth=engine.scheduler.num_queued, worker_id=worker_id, updated_at=time.time(),
                        max_model_len=engine.max_model_len, vocab_size=engine.config.model.vocab_size)

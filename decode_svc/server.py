"""`tandem decode`: one decode worker process."""

from __future__ import annotations

import grpc

from tandem.decode_svc.servicer import DecodeServicer
from tandem.shared import metrics
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.engine.engine import Engine, StepResult
from tandem.shared.service import (
    EngineOptions,
    ServiceOptions,
    build_engine_config,
    new_worker_id,
    run_service,
    worker_record,
)
from tandem.v1 import worker_pb2_grpc


async def serve(service: ServiceOptions, engine_options: EngineOptions, kv_transport: str = "auto",
                max_queued: int = 1024) -> None:
    engine = AsyncEngine(Engine(build_engine_config(engine_options)), name="decode-engine")
    metrics.track_pool(lambda: engine.engine.num_total_blocks, lambda: engine.engine.num_free_blocks,
                       lambda: engine.engine.scheduler.num_queued)

    def on_step(result: StepResult, seconds: float) -> None:
        if result.requests:  # a step that found nothing to run (all waiting for pages) is no batch
            metrics.BATCH_SIZE.observe(len(result.requests))

    engine.on_step = on_step
    servicer = DecodeServicer(engine, engine_options.model, kv_transport, max_queued=max_queued, tls=service.tls)
    worker_id = new_worker_id("decode")

    def add(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        return ["tandem.v1.Decode"]

    async def cleanup() -> None:
        await servicer.close()
        engine.close()

    await run_service(service, add, lambda address: worker_record(engine, "decode", engine_options.model,
                                                                   worker_id, address), cleanup=cleanup,
                      on_drain=servicer.drain)

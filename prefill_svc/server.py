"""`tandem prefill`: one prefill worker process."""

from __future__ import annotations

import grpc

from tandem.prefill_svc.servicer import PrefillServicer
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.engine.engine import Engine
from tandem.shared.metrics import track_pool
from tandem.shared.service import (
    EngineOptions,
    ServiceOptions,
    build_engine_config,
    new_worker_id,
    run_service,
    worker_record,
)
from tandem.v1 import worker_pb2_grpc


async def serve(service: ServiceOptions, engine_options: EngineOptions) -> None:
    engine = AsyncEngine(Engine(build_engine_config(engine_options)), name="prefill-engine")
    track_pool(lambda: engine.engine.num_total_blocks, lambda: engine.engine.num_free_blocks,
               lambda: engine.engine.scheduler.num_queued)
    servicer = PrefillServicer(engine, engine_options.model)
    worker_id = new_worker_id("prefill")

    def add(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        return ["tandem.v1.Prefill"]

    async def cleanup() -> None:
        engine.close()
        servicer.exporter.close()

    await run_service(service, add, lambda address: worker_record(engine, "prefill", engine_options.model,
                                                                   worker_id, address), cleanup=cleanup)

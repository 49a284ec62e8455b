"""`tandem prefill`: one prefill worker process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import grpc

from tandem.common.config import EngineConfig, env_number
from tandem.prefill_svc.servicer import PrefillServicer, add_to_server
from tandem.serving.kv_transfer import EXPORT_SWITCH_INTERVAL_S
from tandem.serving.service import ServiceOptions, run_service
from tandem.serving.worker import new_worker_id, start_engine, worker_record


async def serve(service: ServiceOptions, config: EngineConfig, model_name: str,
                on_started: Callable[[str, int], None] | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM (or `stop`, for a worker run inside a test); with the stack's internal token in
    `service`, every call but health checks and reflection must carry it."""
    # The page exporter's thread and the event loop share the GIL with the engine thread, whose every op and launch
    # releases it (benchmarks/gil_contention.py). TANDEM_PREFILL_SWITCH_INTERVAL_S: an experiment's knob.
    sys.setswitchinterval(env_number("TANDEM_PREFILL_SWITCH_INTERVAL_S", 0.0) or EXPORT_SWITCH_INTERVAL_S)
    engine = start_engine(config, "prefill")
    servicer = PrefillServicer(engine, model_name)
    worker_id = new_worker_id("prefill")

    def add(server: grpc.aio.Server) -> list[str]:
        add_to_server(servicer, server)
        return ["tandem.v1.Prefill"]

    async def cleanup() -> None:
        engine.close()
        servicer.export.close()

    await run_service(service, add, lambda address: worker_record(engine, "prefill", model_name, worker_id, address),
                      cleanup=cleanup, on_started=on_started, stop=stop)

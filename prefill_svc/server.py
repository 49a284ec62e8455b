"""`tandem prefill`: one prefill worker process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import grpc

from tandem.common.config import EngineConfig, env_number
from tandem.prefill_svc.servicer import PrefillServicer, add_to_server
from tandem.serving.kv_transfer import EXPORT_SWITCH_INTERVAL_S
from tandem.serving.rpc import ChannelPool
from tandem.serving.service import ServiceOptions, run_service
from tandem.serving.weight_ipc import fetch_weights, watch_owner
from tandem.serving.worker import new_worker_id, start_engine, worker_record


async def serve(service: ServiceOptions, config: EngineConfig, model_name: str, weights_from: str | None = None,
                on_started: Callable[[str, int], None] | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM (or `stop`, for a worker run inside a test); with the stack's internal token in
    `service`, every call but health checks and reflection must carry it. `weights_from`: the address of a decode
    worker on this GPU whose weights this worker maps instead of loading its own (`tandem.serving.weight_ipc`); it
    waits for that worker to be up, and exits if it goes away."""
    # The page exporter's thread and the event loop share the GIL with the engine thread, whose every op and launch
    # releases it (benchmarks/gil_contention.py). TANDEM_PREFILL_SWITCH_INTERVAL_S: an experiment's knob.
    sys.setswitchinterval(env_number("TANDEM_PREFILL_SWITCH_INTERVAL_S", 0.0) or EXPORT_SWITCH_INTERVAL_S)
    channels = ChannelPool(service.tls, service.internal_token)
    shared_weights, watching = None, None
    if weights_from is not None:
        shared_weights = await fetch_weights(channels.get(weights_from))
    engine = start_engine(config, "prefill", shared_weights=shared_weights)
    if weights_from is not None:
        assert shared_weights is not None
        watching = asyncio.create_task(watch_owner(channels.get(weights_from), shared_weights.owner_pid))
    servicer = PrefillServicer(engine, model_name)
    worker_id = new_worker_id("prefill")

    def add(server: grpc.aio.Server) -> list[str]:
        add_to_server(servicer, server)
        return ["tandem.v1.Prefill"]

    async def cleanup() -> None:
        if watching is not None:
            watching.cancel()
        await channels.close()
        engine.close()
        servicer.export.close()

    await run_service(service, add, lambda address: worker_record(engine, "prefill", model_name, worker_id, address),
                      cleanup=cleanup, on_started=on_started, stop=stop)

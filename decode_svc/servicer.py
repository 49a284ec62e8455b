"""The decode service's gRPC adapter: each RPC hands over to the request runner (`generation.py`), the sessions
(`sessions.py`) or the worker's description. Reserving blocks, pulling pages (`kv_pull.py`) and generating
live in those modules, not here."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from tandem.decode_svc.generation import RequestRunner
from tandem.decode_svc.sessions import Sessions
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.service import session_window
from tandem.serving.weight_ipc import export_weights
from tandem.serving.worker import worker_info
from tandem.v1 import worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, model_name: str, runner: RequestRunner) -> None:
        self.engine = engine
        self.model_name = model_name
        self.runner = runner
        self.sessions = Sessions(runner)

    async def Generate(self, request: worker_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """One request per call (the session's requests take the same path)."""
        remaining = context.time_remaining()  # gRPC Python passes no deadline on: the Prefill call gets the rest
        deadline = None if remaining is None else time.monotonic() + remaining
        responses = self.runner.run(request, deadline, context.invocation_metadata())
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SessionResponse]:
        """Many requests over one stream; the new tokens of all of them go out together."""
        responses = self.sessions.serve(requests, session_window(context.invocation_metadata()))
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.engine, "decode", self.model_name)

    async def Weights(self, request: worker_pb2.WeightsRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.WeightsResponse:
        """This worker's weights as IPC handles, for a prefill worker on its GPU (made for each asker: torch counts
        each share)."""
        runner = self.engine.engine.runner
        return export_weights(runner.model, self.engine.engine.config.model, runner.dtype)

    def drain(self) -> None:
        self.sessions.drain()

    async def close(self) -> None:
        await self.runner.puller.channels.close()

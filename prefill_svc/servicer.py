"""The prefill service's gRPC adapter: compute prompts in batches, let their KV pages leave layer by layer
(`export.py`), then send the first token. Thin: convert the request, hand it to the engine, convert back."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry import trace

from tandem.engine.engine import Engine, StepResult
from tandem.prefill_svc.export import PageExport, PagesEvent
from tandem.prefill_svc.tracing import PrefillTraces
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine, TokenEvent
from tandem.serving.kv_ipc import PoolHandle
from tandem.serving.kv_transfer import check_layout, page_bytes, serialize_prefill_response
from tandem.serving.telemetry import ending, get_tracer
from tandem.serving.wire import layout_from_proto, sampling_from_worker
from tandem.serving.worker import worker_info
from tandem.v1 import worker_pb2, worker_pb2_grpc


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, model_name: str, tracer: trace.Tracer | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        # The process-wide tracer unless one is given (tests host several services in one process).
        self.traces = PrefillTraces(tracer or get_tracer("prefill"))
        self.export = PageExport(engine)
        engine.on_step = self._on_step

    def _on_step(self, result: StepResult, seconds: float) -> None:
        """Engine thread, after each step that computed something."""
        if result.requests:
            metrics.BATCH_SIZE.observe(len(result.requests))
            metrics.PREFILL_PROMPT_TOKENS.inc(sum(result.num_new_tokens))
            self.traces.on_step(result, seconds)

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse | bytes]:
        """`_prefill` inside the request's `prefill` span (continuing the caller's trace). Pages go out as the
        exporter serialized them (bytes: see `add_to_server`)."""
        span = self.traces.start(request.request_id, len(request.prompt_token_ids), context.invocation_metadata())
        try:
            with ending(span):
                async with contextlib.aclosing(self._prefill(request)) as responses:
                    async for response in responses:
                        yield response
        finally:
            self.traces.forget(request.request_id)

    async def _prefill(self, request: worker_pb2.PrefillRequest
                       ) -> AsyncGenerator[worker_pb2.PrefillResponse | bytes, None]:
        engine = self.engine.engine
        check_layout(engine.layout, layout_from_proto(request.layout))
        params = sampling_from_worker(request.sampling)
        req_id = request.request_id
        is_ipc = request.HasField("target")
        mirror = self.export.mirror(request.target) if is_ipc else None
        start = time.perf_counter()
        num_bytes = 0
        flushed = False
        # A resumed request's tokens already streamed are not its first token: a step that ends only a chunk of
        # its prompt must not publish them as one.
        with self.engine.stream(req_id, num_already_sent=len(request.output_token_ids)) as events:
            try:
                prompt, prior = list(request.prompt_token_ids), list(request.output_token_ids)
                await self.engine.call(lambda e: e.add_request(
                    req_id, prompt, params, prefill_only=True, output_token_ids=prior, kv_mirror=mirror,
                    receiver_cached_tokens=request.num_cached_tokens))
                while True:
                    event = await events.next()
                    if isinstance(event, PagesEvent):
                        for message in event.messages:
                            num_bytes += page_bytes(message, engine.layout)
                            yield message.data
                        continue
                    assert isinstance(event, TokenEvent)
                    if not is_ipc and not flushed:
                        # The first token can come before the last pages are made: wait for the exporter (its
                        # pages are queued behind this token then), and take the token again after them.
                        await asyncio.wrap_future(self.export.exported(req_id))
                        flushed = True
                        events.put_back(event)
                        continue
                    if is_ipc and mirror is not None:
                        num_cached_blocks = request.num_cached_tokens // engine.layout.block_size
                        num_bytes = (len(mirror.block_ids) - num_cached_blocks) * engine.layout.block_bytes
                    self.traces.first_token(req_id, event, num_bytes, "cuda-ipc" if is_ipc else "grpc")
                    yield worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(
                        token_id=event.token_ids[-1], logprob=event.logprobs[-1],
                        prefill_s=time.perf_counter() - start))
                    break
            finally:
                # The pages are shipped (or the receiver is gone): free the blocks for the next prompt. Dropped
                # between steps, so no later step writes into the receiver's pool for this request.
                self.engine.post(functools.partial(self._release, req_id))
                metrics.KV_TRANSFER_BYTES.inc(num_bytes)

    def _release(self, req_id: str, engine: Engine) -> None:
        """Engine thread: free the request's blocks; after this no step computes for it, so no export marker of it
        comes later to forget."""
        engine.release(req_id)
        self.export.forget(req_id)

    async def OpenPool(self, request: worker_pb2.OpenPoolRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.OpenPoolResponse:
        """Map a decode worker's pool ahead of its first request (warm start)."""
        check_layout(self.engine.engine.layout, layout_from_proto(request.layout))
        self.export.open_pool(request.pool_id, PoolHandle.from_proto(request.pool))
        return worker_pb2.OpenPoolResponse()

    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        """Returns once no write of the request can follow: it is dropped between steps, after waiting for a launched
        step that computes for it (prefill pipelining, `Engine._settle`); every step read has ended with a host sync
        on the stream its stores (and the peer-pool stores) ran on, so nothing of it is pending."""
        req_id = request.request_id

        def release(engine: Engine) -> None:
            engine.abort(req_id)

        await self.engine.call(release)
        return worker_pb2.ReleaseResponse()

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.engine, "prefill", self.model_name)


def add_to_server(servicer: worker_pb2_grpc.PrefillServicer, server: grpc.aio.Server) -> None:
    """`worker_pb2_grpc.add_PrefillServicer_to_server`, except that the Prefill stream may yield responses
    serialized already (the pages): they are sent as they are."""
    handlers = {
        "Prefill": grpc.unary_stream_rpc_method_handler(
            servicer.Prefill, request_deserializer=worker_pb2.PrefillRequest.FromString,
            response_serializer=serialize_prefill_response),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=worker_pb2.InfoRequest.FromString,
            response_serializer=worker_pb2.WorkerInfo.SerializeToString),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release, request_deserializer=worker_pb2.ReleaseRequest.FromString,
            response_serializer=worker_pb2.ReleaseResponse.SerializeToString),
        "OpenPool": grpc.unary_unary_rpc_method_handler(
            servicer.OpenPool, request_deserializer=worker_pb2.OpenPoolRequest.FromString,
            response_serializer=worker_pb2.OpenPoolResponse.SerializeToString),
    }
    service = worker_pb2.DESCRIPTOR.services_by_name["Prefill"]
    assert set(handlers) == {method.name for method in service.methods}, "a Prefill method is not registered"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)

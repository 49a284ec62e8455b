"""The prefill service: compute prompts in batches, stream their KV pages layer by layer, then the
first token. Thin: convert the request, hand it to the engine, convert what comes back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import trace

from tandem.common.errors import KVTransportError
from tandem.engine.engine import Engine, StepResult
from tandem.engine.request import Request
from tandem.prefill_svc.tracing import PrefillTraces
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine, TokenEvent
from tandem.serving.kv_ipc import PoolHandle, copy_layer, open_pool
from tandem.serving.kv_transfer import PageExporter, check_layout, page_bytes
from tandem.serving.telemetry import ending, get_tracer
from tandem.serving.wire import layout_from_proto, sampling_from_worker
from tandem.serving.worker import worker_info
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class PagesEvent:
    """One layer's pages of one request, already on the host."""

    layer: int
    messages: list[worker_pb2.KVPages]


@dataclass
class IpcTarget:
    """Where one request's pages go in a peer's pool (cuda-ipc)."""

    pool: torch.Tensor  # the peer's [L, 2, N, B, Hkv, D], mapped into this process
    dst_blocks: torch.Tensor  # [num_blocks] int64 on the GPU
    src_blocks: torch.Tensor | None = None  # ours, filled at the first layer (the blocks are known then)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, model_name: str, tracer: trace.Tracer | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        # The process-wide tracer unless one is given (tests host several services in one process).
        self.traces = PrefillTraces(tracer or get_tracer("prefill"))
        engine.on_prefill_layer = self._export_layer
        engine.on_step = self._on_step
        # cuda-ipc: peers' pools opened once (pool id → tensor), and each request's target.
        self._pools: dict[str, torch.Tensor] = {}
        self._targets: dict[str, IpcTarget] = {}
        # grpc: pages come down to the host and become messages off the engine thread.
        self.exporter = PageExporter(engine.engine.runner.kv_cache.tensor)

    def _export_layer(self, requests: list[Request], layer: int) -> None:
        """Engine thread, right after `layer` stored its K/V: hand each request's pages on, so shipping
        layer L overlaps computing layer L+1 (grpc: copied to the host on a side stream and made into
        messages on the exporter's thread; cuda-ipc: copied on the GPU straight into the receiver's pool)."""
        cache = self.engine.engine.runner.kv_cache.tensor
        for request in requests:
            target = self._targets.get(request.req_id)
            if target is not None:
                if target.src_blocks is None:
                    target.src_blocks = torch.tensor(request.block_ids, dtype=torch.int64, device=cache.device)
                copy_layer(cache, target.src_blocks, target.pool, target.dst_blocks, layer)
                continue
            self.exporter.submit(layer, list(request.block_ids),
                                 lambda messages, req_id=request.req_id, layer=layer:
                                 self.engine.post_event(req_id, PagesEvent(layer, messages)))

    def _on_step(self, result: StepResult, seconds: float) -> None:
        """Engine thread, after each step that computed something."""
        if result.requests:
            metrics.BATCH_SIZE.observe(len(result.requests))
            metrics.PREFILL_PROMPT_TOKENS.inc(sum(r.num_tokens for r in result.requests))
            self.traces.on_step(result, seconds)

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse]:
        """`_prefill` inside the request's `prefill` span (continuing the caller's trace)."""
        span = self.traces.start(request.request_id, len(request.prompt_token_ids), context.invocation_metadata())
        try:
            with ending(span):
                async with contextlib.aclosing(self._prefill(request)) as responses:
                    async for response in responses:
                        yield response
        finally:
            self.traces.forget(request.request_id)

    async def _prefill(self, request: worker_pb2.PrefillRequest
                       ) -> AsyncGenerator[worker_pb2.PrefillResponse, None]:
        engine = self.engine.engine
        check_layout(engine.layout, layout_from_proto(request.layout))
        params = sampling_from_worker(request.sampling)
        req_id = request.request_id
        if request.HasField("target"):
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            self._targets[req_id] = self._open_target(request.target, num_tokens)
        start = time.perf_counter()
        num_bytes = 0
        flushed = False
        with self.engine.stream(req_id) as events:
            try:
                prompt, prior = list(request.prompt_token_ids), list(request.output_token_ids)
                await self.engine.call(lambda e: e.add_request(req_id, prompt, params, prefill_only=True,
                                                               output_token_ids=prior))
                while True:
                    event = await events.next()
                    if isinstance(event, PagesEvent):
                        for message in event.messages:
                            num_bytes += page_bytes(message, engine.layout)
                            yield worker_pb2.PrefillResponse(pages=message)
                        continue
                    assert isinstance(event, TokenEvent)
                    if not request.HasField("target") and not flushed:
                        # The first token can come before the last pages are made: wait for the exporter (its
                        # pages are queued behind this token then), and take the token again after them.
                        await asyncio.wrap_future(self.exporter.flush())
                        flushed = True
                        events.put_back(event)
                        continue
                    self.traces.first_token(req_id, event, num_bytes,
                                            "cuda-ipc" if request.HasField("target") else "grpc")
                    yield worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(
                        token_id=event.token_ids[-1], logprob=event.logprobs[-1],
                        prefill_s=time.perf_counter() - start))
                    break
            finally:
                # The pages are shipped (or the receiver is gone): the blocks are free for the next prompt, and no
                # later layer is written into the receiver's pool (it calls Release to wait for queued copies).
                self.engine.post(lambda e: (self._targets.pop(req_id, None), e.release(req_id)))
                metrics.KV_TRANSFER_BYTES.inc(num_bytes)

    def _open_target(self, target: worker_pb2.KVTarget, num_prompt_tokens: int) -> IpcTarget:
        pool = self._pools.get(target.pool_id)
        if pool is None:
            if not target.HasField("pool"):
                raise KVTransportError(f"cuda-ipc: unknown pool {target.pool_id}; send its handle")
            engine = self.engine.engine
            pool = open_pool(PoolHandle.from_proto(target.pool), engine.layout, engine.runner.device)
            self._pools[target.pool_id] = pool
        block_size = self.engine.engine.runner.block_size
        if len(target.block_ids) != -(-num_prompt_tokens // block_size):
            raise KVTransportError(f"cuda-ipc: {len(target.block_ids)} target blocks for {num_prompt_tokens} tokens")
        if max(target.block_ids) >= pool.shape[2]:
            raise KVTransportError("cuda-ipc: a target block id is outside the peer's pool")
        dst = torch.tensor(list(target.block_ids), dtype=torch.int64, device=pool.device)
        return IpcTarget(pool, dst)

    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        req_id = request.request_id

        def release(engine: Engine) -> None:
            # Between steps: no forward is running; after the sync no copy is queued either.
            self._targets.pop(req_id, None)
            engine.abort(req_id)
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize(engine.runner.device)

        await self.engine.call(release)
        return worker_pb2.ReleaseResponse()

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.engine, "prefill", self.model_name)


"""The decode service: reserve blocks, pull the prompt's pages from a prefill worker into them, join
the running batch, stream token ids. Falls back to prefilling locally when no prefill worker answers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from tandem.shared import metrics
from tandem.shared.async_engine import AsyncEngine, EngineFailure, TokenEvent
from tandem.shared.engine.request import Request
from tandem.shared.engine.sampling_params import SamplingParams
from tandem.shared.kv_transfer import layout_to_proto, messages_to_pages
from tandem.shared.rpc import make_channel
from tandem.shared.service import is_unreachable, worker_info
from tandem.shared.wire import finish_reason_to_proto, sampling_from_worker, sampling_to_worker
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# How often a request that found no free blocks tries again (the pool frees blocks every step).
_RESERVE_RETRY_S = 0.005


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def Generate(self, request: worker_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeResponse]:
        arrival = time.perf_counter()
        req_id = request.request_id
        prompt = list(request.prompt_token_ids)
        params = sampling_from_worker(request.sampling)
        events = self.engine.open_stream(req_id)
        try:
            remote_ok = False
            if request.prefill_address:
                remote_ok = await self._prefill_remotely(req_id, prompt, params, request.prefill_address)
            if not remote_ok:
                await self.engine.call(lambda e: e.add_request(req_id, prompt, params))
            first = True
            while True:
                event = await events.get()
                if isinstance(event, EngineFailure):
                    raise event
                assert isinstance(event, TokenEvent)
                response = worker_pb2.DecodeResponse(
                    token_ids=event.token_ids, logprobs=event.logprobs,
                    finish_reason=finish_reason_to_proto(event.finish_reason) if event.finish_reason else 0)
                if first:
                    response.time_to_first_token_s = time.perf_counter() - arrival
                    response.num_local_prefill_tokens = event.num_local_prefill_tokens
                    metrics.LOCAL_PREFILL_TOKENS.inc(event.num_local_prefill_tokens)
                    first = False
                yield response
                if event.finish_reason is not None:
                    metrics.REQUESTS.labels(status=event.finish_reason).inc()
                    return
        finally:
            self.engine.close_stream(req_id)
            # Cancelled, failed or done: either way the request's blocks are free now.
            self.engine.post(lambda e: e.abort(req_id))

    async def _prefill_remotely(self, req_id: str, prompt: list[int], params: SamplingParams,
                                address: str) -> bool:
        """Reserve blocks, pull the pages and the first token; False if the prefill worker failed
        (its partial pages are dropped with the reservation, and the caller prefills locally)."""
        engine = self.engine
        while True:
            reserved: Request | None = await engine.call(lambda e: e.reserve(req_id, prompt, params))
            if reserved is not None:
                break
            await asyncio.sleep(_RESERVE_RETRY_S)
        request = reserved
        layout = engine.engine.layout
        stub = worker_pb2_grpc.PrefillStub(self._channel(address))
        call = stub.Prefill(worker_pb2.PrefillRequest(
            request_id=req_id, prompt_token_ids=prompt, sampling=sampling_to_worker(params),
            layout=layout_to_proto(layout)))
        start = time.perf_counter()
        num_bytes = 0
        try:
            async for message in call:
                if message.HasField("pages"):
                    pages = message.pages
                    k, v = messages_to_pages(pages, layout)
                    num_bytes += len(pages.k) + len(pages.v)
                    layer, block_start = pages.layer, pages.block_start
                    engine.post(lambda e, k=k, v=v, layer=layer, start=block_start:
                                e.write_pages(request, layer, start, k, v))
                else:
                    first = message.first_token

                    def activate(e, token_id: int = first.token_id, logprob: float = first.logprob) -> None:
                        e.activate(request, token_id, logprob)
                        engine.publish(request)

                    await engine.call(activate)
                    metrics.KV_TRANSFER_BYTES.inc(num_bytes)
                    metrics.KV_TRANSFER_SECONDS.observe(time.perf_counter() - start)
                    return True
            raise ValueError("prefill stream ended without a first token")
        except (grpc.aio.AioRpcError, ValueError) as error:
            if isinstance(error, grpc.aio.AioRpcError) and not is_unreachable(error):
                await engine.call(lambda e: e.abort(req_id))
                raise
            log.warning("prefill at %s failed for %s (%s); prefilling locally", address, req_id, error)
            metrics.KV_TRANSFER_FAILURES.inc()
            await engine.call(lambda e: e.abort(req_id))
            return False
        finally:
            call.cancel()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = make_channel(address)
        return self._channels[address]

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.engine, "decode", self.model_name)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

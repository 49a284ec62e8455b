"""The prefill service: compute prompts in batches, stream their KV pages layer by layer, then the
first token. Thin: convert the request, hand it to the engine, convert what comes back."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from tandem.shared import metrics
from tandem.shared.async_engine import AsyncEngine, EngineFailure, TokenEvent
from tandem.shared.engine.request import Request
from tandem.shared.kv_transfer import check_layout, layout_from_proto, pages_to_messages
from tandem.shared.service import worker_info
from tandem.shared.wire import sampling_from_worker
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class PagesEvent:
    """One layer's pages of one request, already on the host."""

    layer: int
    messages: list[worker_pb2.KVPages]


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        engine.on_prefill_layer = self._export_layer

    def _export_layer(self, requests: list[Request], layer: int) -> None:
        """Engine thread, right after `layer` stored its K/V: copy each request's pages out, so the
        event loop ships layer L while the engine computes layer L+1."""
        for request in requests:
            k, v = self.engine.engine.read_pages(request, layer)
            messages = list(pages_to_messages(layer, k.cpu(), v.cpu()))
            self.engine.post_event(request.req_id, PagesEvent(layer, messages))

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse]:
        engine = self.engine.engine
        check_layout(engine.layout, layout_from_proto(request.layout))
        params = sampling_from_worker(request.sampling)
        req_id = request.request_id
        start = time.perf_counter()
        events = self.engine.open_stream(req_id)
        num_bytes = 0
        try:
            prompt = list(request.prompt_token_ids)
            await self.engine.call(lambda e: e.add_request(req_id, prompt, params, prefill_only=True))
            while True:
                event = await events.get()
                if isinstance(event, PagesEvent):
                    for message in event.messages:
                        num_bytes += len(message.k) + len(message.v)
                        yield worker_pb2.PrefillResponse(pages=message)
                    continue
                if isinstance(event, EngineFailure):
                    raise event
                assert isinstance(event, TokenEvent)
                yield worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(
                    token_id=event.token_ids[0], logprob=event.logprobs[0],
                    prefill_s=time.perf_counter() - start))
                break
        finally:
            self.engine.close_stream(req_id)
            # The pages are shipped (or the receiver is gone): the blocks are free for the next prompt.
            self.engine.post(lambda e: e.release(req_id))
            metrics.KV_TRANSFER_BYTES.inc(num_bytes)

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.engine, "prefill", self.model_name)


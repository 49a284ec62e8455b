"""The public `tandem.v1.Generation` service: a thin adapter over the `Router` (convert, call, convert back)."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from tandem.gateway.router import PassthroughError, Router
from tandem.serving.telemetry import ending, extract_context
from tandem.serving.wire import finish_reason_to_proto, sampling_from_public
from tandem.v1 import generation_pb2, generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _prompt_ids(self, message: Any) -> list[int]:
        kind = message.WhichOneof("input")
        if kind == "prompt":
            return await self.router.prompt_ids(prompt=message.prompt)
        if kind == "prompt_token_ids":
            return await self.router.prompt_ids(token_ids=list(message.prompt_token_ids.ids))
        if kind == "messages":
            return await self.router.prompt_ids(messages=[{"role": m.role, "content": m.content}
                                                          for m in message.messages.messages])
        return await self.router.prompt_ids()

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """Traced as the root span `generate` (under the client's trace, if it sent one).

        A coroutine that streams through `context.write`, not an async generator: grpc.aio then drives one
        coroutine per call, and the wrappers around the handler (`map_errors`, `MalformedRequestInterceptor`) stay
        coroutines too, where as generators each added a generator step to every message. On a client's cancel the
        `CancelledError` comes out of `write` here, and `aclosing` ends the router's stream at once."""
        span = self.router.tracer.start_span("generate", context=extract_context(context.invocation_metadata()),
                                             kind=SpanKind.SERVER)
        try:
            with ending(span):
                # Current only around these steps (no yield inside), so `tokenize` nests under it. The cheap
                # checks come first: a request refused for its parameters is never tokenized.
                with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                    self.router.check_model(request.model)
                    params = sampling_from_public(request.sampling)
                    self.router.check_sampling(params)
                    prompt_ids = await self._prompt_ids(request)
                request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
                span.set_attribute("tandem.request_id", request_id)
                chunks = self.router.stream(request_id, prompt_ids, params, timeout=context.time_remaining(),
                                            trace_context=trace.set_span_in_context(span))
                async with contextlib.aclosing(chunks):
                    async for new_ids, text, progress in chunks:
                        response = generation_pb2.GenerateResponse(request_id=request_id, text=text,
                                                                   token_ids=new_ids)
                        if progress.finish_reason is not None:
                            response.finish_reason = finish_reason_to_proto(progress.finish_reason)
                            response.usage.prompt_tokens = len(prompt_ids)
                            response.usage.completion_tokens = len(progress.token_ids)
                            response.usage.cached_tokens = progress.num_cached_tokens
                            response.timing.time_to_first_token_s = progress.time_to_first_token_s
                            response.timing.e2e_s = progress.e2e_s
                        await context.write(response)
        except PassthroughError as error:
            await context.abort(error.code, error.details)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        self.router.check_model(request.model)
        return generation_pb2.TokenizeResponse(token_ids=await self._prompt_ids(request))

    async def ListModels(self, request: generation_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.ListModelsResponse:
        router = self.router
        card = generation_pb2.ModelCard(id=router.model.name, max_model_len=router.max_model_len,
                                        vocab_size=router.vocab_size)
        return generation_pb2.ListModelsResponse(models=[card])

"""The OpenAI-compatible HTTP API: a second door into the gateway's pipeline, next to gRPC.

One FastAPI app on the gateway's HTTP port, served by uvicorn inside the gateway's event loop, so it
shares the gRPC servicer's `Router` (routing, detokenization, stop strings, limits, concurrency slots), not a
copy of it. Also serves `/health` and the Prometheus `/metrics`. In front of the app, `RequestGuard` refuses a
body past `--max-request-bytes` (413) before reading it whole, and every request to `/v1/` while the gateway
drains (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import AsyncGenerator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from starlette.types import Receive, Scope, Send

from tandem.common.errors import TandemError
from tandem.common.sampling_params import SamplingParams
from tandem.gateway.auth import ApiKeys
from tandem.gateway.http_errors import add_error_handlers, error_response, openai_params
from tandem.gateway.http_guard import RequestGuard, RequireApiKey
from tandem.gateway.openai_protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseHeader,
    chat_logprobs,
    usage,
)
from tandem.gateway.router import Completion, Router
from tandem.gateway.workers import METRICS_DIR_ENV
from tandem.serving.telemetry import ending, extract_context, record_error

log = logging.getLogger(__name__)

_T = TypeVar("_T")
# (choice index, new token ids, new text, the choice's progress so far)
_Event = tuple[int, list[int], str, Completion]
# What one wake-up brings: every choice's chunk that came since the last one (a single choice: all its tokens that
# came, in one chunk). The stream writes them to the client at once.
_Events = list[_Event]

# Tokens whose logprobs a non-streamed reply renders on the event loop at most (~20 ms for 8192 on the 2-core
# CPU host; 128 choices of them would be seconds).
_OFFLOAD_LOGPROB_TOKENS = 4096

# The router names fields after the gRPC API; a client of this API must hear its own field names.
_CHAT_PARAMS = {"prompt": "messages", "prompt_token_ids": "messages", "input": "messages"}
_COMPLETION_PARAMS = {"prompt_token_ids": "prompt", "input": "prompt"}


@dataclass(frozen=True)
class _Choice:
    """One sequence to generate: choice `index` of the response, sample of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Endpoint:
    """How one endpoint words the same events: chat (message/delta) or legacy completion (text)."""

    is_chat: bool
    with_logprobs: bool
    include_usage: bool
    renames: dict[str, str] = field(default_factory=dict)

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, final: bool,
               first: bool = False) -> dict[str, Any]:
        if not self.is_chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if final:
            body = {"role": "assistant", "content": text}
            return {"index": index, "message": body, "logprobs": logprobs, "finish_reason": finish_reason}
        # The first chunk of each choice carries the role, as OpenAI's do.
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, tokenizer: Any, token_ids: list[int], logprobs: list[float]) -> Any:
        if not self.with_logprobs:
            return None
        if self.is_chat:
            return chat_logprobs(tokenizer, token_ids, logprobs)
        return {"tokens": [tokenizer.decode([t]) for t in token_ids], "token_logprobs": logprobs,
                "top_logprobs": None, "text_offset": None}


def create_app(router: Router, api_keys: ApiKeys | None = None) -> FastAPI:
    """The app serving `router`'s model. Errors answer in OpenAI's body shape. With `api_keys` enabled,
    `/v1/*` needs `Authorization: Bearer <key>` (or `x-api-key`); `/health` and `/metrics` stay open."""
    app = FastAPI(title="tandem", summary="OpenAI-compatible API of a tandem gateway")
    add_error_handlers(app)
    app.add_middleware(RequestGuard, router=router)
    if api_keys is not None and api_keys.enabled:  # outermost: a caller without a key gets nothing else
        app.add_middleware(RequireApiKey, keys=api_keys)

    model = router.model

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        renames = _CHAT_PARAMS
        if body.max_completion_tokens is not None:
            renames = {**renames, "max_tokens": "max_completion_tokens"}
        endpoint = _Endpoint(is_chat=True, with_logprobs=body.logprobs, include_usage=body.include_usage,
                             renames=renames)
        span = _start_span(router, request, "chat.completions")
        with _current_until_error(span), openai_params(endpoint.renames):
            router.check_model(body.model)
            body.check_supported()
            body.check_limits(router.limits, num_prompts=1)
            prompt_ids = await router.prompt_ids(messages=[m.as_template_input() for m in body.messages])
            default_max_tokens = router.max_model_len - len(prompt_ids)
            choices = [_Choice(j, 0, prompt_ids, body.sampling_params(body.requested_max_tokens,
                                                                      default_max_tokens, j))
                       for j in range(body.n)]
        header = ResponseHeader.new("chatcmpl", "chat.completion.chunk" if body.stream else "chat.completion",
                                    model.name)
        return await _respond(router, request, endpoint, header, choices, body.stream, span)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        endpoint = _Endpoint(is_chat=False, with_logprobs=body.logprobs is not None,
                             include_usage=body.include_usage, renames=_COMPLETION_PARAMS)
        span = _start_span(router, request, "completions")
        with _current_until_error(span), openai_params(endpoint.renames):
            router.check_model(body.model)
            body.check_supported()
            prompts = body.prompts()
            body.check_limits(router.limits, num_prompts=len(prompts))
            choices = []
            for i, prompt in enumerate(prompts):
                ids = await (router.prompt_ids(prompt=prompt) if isinstance(prompt, str)
                             else router.prompt_ids(token_ids=prompt))
                choices += [_Choice(i * body.n + j, i, ids, body.sampling_params(
                    body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, j)) for j in range(body.n)]
        header = ResponseHeader.new("cmpl", "text_completion", model.name)
        return await _respond(router, request, endpoint, header, choices, body.stream, span)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(router)]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        router.check_model(name)
        return _model_card(router)

    @app.get("/health")
    async def health() -> Response:
        # Ready means a request could be routed now: not draining, and at least one decode worker is known.
        if router.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not router.registry.workers("decode"):
            return JSONResponse({"status": "no decode worker"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(_metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def _metrics_text() -> bytes:
    """This process's metrics; under `tandem gateway --workers N` (prometheus_client's multiprocess mode, which
    `PROMETHEUS_MULTIPROC_DIR` turns on) those of all N processes, whichever of them answers: counters and
    histograms summed, gauges one series per process (`pid` label)."""
    if os.environ.get(METRICS_DIR_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()


def _model_card(router: Router) -> dict[str, Any]:
    return {"id": router.model.name, "object": "model", "created": 0, "owned_by": "tandem",
            "max_model_len": router.max_model_len}


async def _respond(router: Router, request: Request, endpoint: _Endpoint, header: ResponseHeader,
                   choices: list[_Choice], stream: bool, span: Span) -> Response:
    span.set_attributes({"tandem.request_id": header.id, "tandem.num_choices": len(choices)})
    events = _generate(router, header.id, choices, span)
    if not stream:
        finals = await _unless_disconnected(request, _collect(events, endpoint))
        if finals is None:
            return Response(status_code=499)  # nobody is listening; the requests were cancelled
        if endpoint.with_logprobs and sum(len(f.token_ids) for f in finals.values()) > _OFFLOAD_LOGPROB_TOKENS:
            # Each token's text is a decode call, and the body is large: built and rendered on a thread, in small
            # steps (a call per token, a JSON dump per choice) between which the event loop gets the GIL back.
            content = await asyncio.to_thread(
                lambda: _render_json(_final_body(router, endpoint, header, choices, finals)))
            return Response(content, media_type="application/json")
        return JSONResponse(_final_body(router, endpoint, header, choices, finals))
    # The first event comes before the response starts, so that a request refused by the router or by
    # decode (a bad value, no worker, overload) gets a real status code rather than a 200 with an error.
    with openai_params(endpoint.renames):
        try:
            first = await anext(events)
        except StopAsyncIteration:  # no choices: cannot happen (n >= 1, prompts non-empty)
            first = []
    return _EventStream(_sse(router, endpoint, header, choices, first, events), events)


async def _collect(events: AsyncGenerator[_Events, None],
                   endpoint: _Endpoint) -> dict[int, Completion]:
    finals: dict[int, Completion] = {}
    with openai_params(endpoint.renames):
        async with contextlib.aclosing(events):
            async for batch in events:
                for index, _, _, progress in batch:
                    if progress.finish_reason is not None:
                        finals[index] = progress
    return finals


def _final_body(router: Router, endpoint: _Endpoint, header: ResponseHeader, choices: list[_Choice],
                finals: dict[int, Completion]) -> dict[str, Any]:
    tokenizer = router.model.tokenizer
    bodies = []
    for choice in choices:
        done = finals[choice.index]
        logprobs = endpoint.logprobs(tokenizer, done.token_ids, done.logprobs)
        bodies.append(endpoint.choice(choice.index, done.text, logprobs, done.finish_reason, final=True))
    return header.body(bodies, usage=_usage(choices, finals))


def _render_json(body: dict[str, Any]) -> bytes:
    """`body` as JSONResponse renders it, its choices dumped one at a time (each dump holds the GIL throughout)."""
    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    fields = [f"{dumps(key)}:" + ("[" + ",".join(dumps(c) for c in value) + "]" if key == "choices" else dumps(value))
              for key, value in body.items()]
    return ("{" + ",".join(fields) + "}").encode("utf-8")


def _usage(choices: list[_Choice], finals: dict[int, Completion]) -> dict[str, Any]:
    # As OpenAI counts: each prompt once, however many samples it has (its cached tokens: its first sample's);
    # every sample's tokens.
    prompt_lengths = {c.prompt_index: len(c.prompt_ids) for c in choices}
    cached: dict[int, int] = {}
    for choice in choices:
        if choice.index in finals:
            cached.setdefault(choice.prompt_index, finals[choice.index].num_cached_tokens)
    return usage(sum(prompt_lengths.values()), sum(len(p.token_ids) for p in finals.values()), sum(cached.values()))


async def _sse(router: Router, endpoint: _Endpoint, header: ResponseHeader, choices: list[_Choice],
               first: _Events, events: AsyncGenerator[_Events, None]) -> AsyncGenerator[str, None]:
    """Server-sent events: a chunk per choice per wake-up that adds text, written to the client together (one
    write per wake-up, however many tokens and choices it carries); `[DONE]` at the end. An error after the first
    chunk is sent as an `error` event (the status line has gone already)."""
    tokenizer = router.model.tokenizer
    started: set[int] = set()
    finals: dict[int, Completion] = {}
    # Every chunk repeats the response's header (and `"usage": null` with include_usage): rendered once, here.
    extra = {"usage": None} if endpoint.include_usage else {}
    head = ",".join(f"{_dumps(key)}:{_dumps(value)}" for key, value in header.body([]).items() if key != "choices")
    prefix = "data: {" + head + ',"choices":['
    suffix = "]" + "".join(f",{_dumps(key)}:{_dumps(value)}" for key, value in extra.items()) + "}\n\n"

    def chunk(index: int, new_ids: list[int], text: str, progress: Completion) -> str | None:
        is_first = index not in started
        started.add(index)
        if progress.finish_reason is not None:
            finals[index] = progress
        if not (text or is_first or progress.finish_reason or (new_ids and endpoint.with_logprobs)):
            return None  # all held back by the detokenizer (a partial character or stop string)
        num_done = len(progress.token_ids)
        logprobs = endpoint.logprobs(tokenizer, new_ids, progress.logprobs[num_done - len(new_ids):num_done])
        body = endpoint.choice(index, text, logprobs, progress.finish_reason, final=False, first=is_first)
        return prefix + _dumps(body) + suffix  # = _event(header.body([body], **extra))

    def chunks(batch: _Events) -> str:
        return "".join(event for item in batch if (event := chunk(*item)) is not None)

    try:
        async with contextlib.aclosing(events):
            with openai_params(endpoint.renames):
                if written := chunks(first):
                    yield written
                async for batch in events:
                    if written := chunks(batch):
                        yield written
        if endpoint.include_usage:
            yield _event(header.body([], usage=_usage(choices, finals)))
    except TandemError as error:
        status, body = error_response(error)
        log.info("stream %s ended by %s (%d)", header.id, type(error).__name__, status)
        yield _event(body)
    yield "data: [DONE]\n\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _event(body: dict[str, Any]) -> str:
    return f"data: {_dumps(body)}\n\n"


async def _generate(router: Router, request_id: str, choices: list[_Choice],
                    span: Span) -> AsyncGenerator[_Events, None]:
    """All choices' router streams, concurrently, merged as (choice index, new ids, new text, progress), in
    batches: what came since the consumer last asked.

    Each choice is its own decode request, traced under `span`, which ends with this generator. Closing
    the generator (a client gone, an error in one choice) cancels every choice still running, so decode
    frees their blocks at once.
    """
    with ending(span):
        trace_context = trace.set_span_in_context(span)
        if len(choices) == 1:
            events = _single(router, request_id, choices[0], trace_context)
        else:
            events = _merged(router, request_id, choices, trace_context)
        async with contextlib.aclosing(events):
            async for batch in events:
                yield batch


async def _single(router: Router, request_id: str, choice: _Choice,
                  trace_context: otel_context.Context) -> AsyncGenerator[_Events, None]:
    """One choice: its router stream read in this task (no task and queue in between: a wake-up less per
    message); the stream takes its own concurrency slot."""
    stream = router.stream(f"{request_id}-{choice.index}", choice.prompt_ids, choice.params,
                           trace_context=trace_context)
    async with contextlib.aclosing(stream):
        async for new_ids, text, progress in stream:
            yield [(choice.index, new_ids, text, progress)]


async def _merged(router: Router, request_id: str, choices: list[_Choice],
                  trace_context: otel_context.Context) -> AsyncGenerator[_Events, None]:
    queue: asyncio.Queue[_Event | asyncio.Task[None]] = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        stream = router.stream(f"{request_id}-{choice.index}", choice.prompt_ids, choice.params,
                               trace_context=trace_context)
        # aclosing: a cancel that lands while this task waits on the queue still closes the decode call.
        async with contextlib.aclosing(stream):
            async for new_ids, text, progress in stream:
                queue.put_nowait((choice.index, new_ids, text, progress))

    # One concurrency slot per choice, all taken here at once (or the request is refused whole); the choices'
    # router streams use them rather than each taking one.
    with router.admission.hold(len(choices)) as slots:
        tasks = [slots.create_task(pump(c)) for c in choices]
        for task in tasks:
            # A finished task reports itself through the queue, so its error reaches the consumer in order.
            task.add_done_callback(queue.put_nowait)
        try:
            num_running = len(tasks)
            while num_running:
                # Everything that came since the last batch, in order; a choice's error ends the stream after the
                # events that came before it.
                batch: _Events = []
                item = await queue.get()
                while True:
                    if isinstance(item, asyncio.Task):
                        num_running -= 1
                        error = None if item.cancelled() else item.exception()
                        if error is not None:
                            if batch:
                                yield batch
                            raise error
                    else:
                        batch.append(item)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                if batch:
                    yield batch
        finally:
            for task in tasks:
                task.cancel()
            # Wait for the cancels to run: each closes its decode stream (freeing blocks) before we return.
            await asyncio.gather(*tasks, return_exceptions=True)


class _EventStream(StreamingResponse):
    """An SSE response that closes its generators when the response ends, however it ends.

    Starlette cancels the body on a client disconnect, but if that lands while the body is paused at a
    `yield` (between chunks), or before the body has started, the generators would stay open until
    garbage-collected, and with them the decode requests and their KV blocks. Closing the body, then the
    `events` it would have consumed, cancels the requests at once.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[str, None], events: AsyncGenerator[_Events, None]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generators = (body, events)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generator in self._generators:
                await generator.aclose()


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """`work`'s result, or None (with `work` cancelled) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    return None if work_task.cancelled() else work_task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read (FastAPI parsed it), so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _start_span(router: Router, request: Request, name: str) -> Span:
    # A root span per request, under the caller's trace if its headers carry one (W3C traceparent).
    return router.tracer.start_span(name, context=extract_context(request.headers.items()), kind=SpanKind.SERVER)


@contextlib.contextmanager
def _current_until_error(span: Span) -> Iterator[None]:
    """`span` current around the request's validation (so `tokenize` nests under it), and ended here
    if validation fails; otherwise `_generate` ends it with the request."""
    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        try:
            yield
        except TandemError as error:
            record_error(span, error)
            span.end()
            raise


# Serving --------------------------------------------------------------------------------------------


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in the gateway's own event loop. The gateway's drain owns SIGTERM/SIGINT, so uvicorn must
    not take the signal handlers over."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    """The running HTTP API: its bound port, and how to stop it."""

    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self, force: bool = False) -> None:
        """Stop serving; requests in flight get the grace period unless `force` (it has run out already)."""
        self.server.force_exit = force
        self.server.should_exit = True
        await self.task


async def start_http_server(app: FastAPI, host: str, port: int, grace_s: float = 30.0,
                            reuse_port: bool = False) -> HttpServer:
    """Serve `app` on host:port (0 picks a port) from the running event loop. Streams in flight get up to
    `grace_s` to finish when stopped. With `reuse_port` (SO_REUSEPORT), other processes may listen on the same
    port, and the kernel spreads the connections among them (`tandem gateway --workers N`)."""
    # Bound and listening before returning: a client that learns the port can connect at once.
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                reuse_port=reuse_port)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=int(grace_s))
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task  # raises what stopped it
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    bound_port = int(sock.getsockname()[1])
    log.info("OpenAI-compatible HTTP API on %s:%d", host, bound_port)
    return HttpServer(bound_port, server, task)


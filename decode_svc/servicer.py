"""The decode service: reserve blocks, pull the prompt's pages from a prefill worker into them, join
the running batch, stream token ids. Falls back to prefilling locally when no prefill worker answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from tandem.decode_svc.tracing import DecodeTraces
from tandem.shared import metrics
from tandem.shared.async_engine import AsyncEngine, EngineFailure, TokenEvent
from tandem.shared.engine.engine import Engine
from tandem.shared.engine.request import Request
from tandem.shared.engine.sampling_params import SamplingParams
from tandem.shared.errors import DeadlineExceededError, KVTransportError, OverloadedError, TandemError
from tandem.shared.kv_ipc import CUDA_IPC, GRPC, ExportedPool, choose_transport, gpu_uuid
from tandem.shared.kv_transfer import layout_to_proto, messages_to_pages, page_bytes
from tandem.shared.rpc import TlsConfig, make_channel, status_of
from tandem.shared.service import is_unreachable, worker_info
from tandem.shared.telemetry import ending, get_tracer, inject_metadata, record_error
from tandem.shared.wire import finish_reason_to_proto, sampling_from_worker, sampling_to_worker
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class PeerState:
    """What this decode worker knows of one prefill worker."""

    gpu_uuid: str = ""
    kv_transports: list[str] = field(default_factory=lambda: [GRPC])
    has_handle: bool = False  # it has opened our pool
    failed_ipc: bool = False  # it could not open it: use grpc from now on

@dataclass(eq=False)  # hashed by identity: the servicer keeps a set of its sessions
class _Session:
    """One gateway's session: its requests in flight, and the updates not yet sent."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # The next message, filled in place (each update is copied once, into it).
    pending: worker_pb2.SessionResponse = field(default_factory=worker_pb2.SessionResponse)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # something to send, or to re-check

    def send(self, req_id: str, response: worker_pb2.DecodeResponse) -> None:
        self.pending.updates.add(request_id=req_id, response=response)
        self.ready.set()

    def fail(self, req_id: str, code: grpc.StatusCode, message: str) -> None:
        self.pending.updates.add(request_id=req_id, error_code=code.value[0], error_message=message)
        self.ready.set()

    def take(self) -> worker_pb2.SessionResponse | None:
        """The message to send now (None if nothing is pending)."""
        if not self.pending.updates:
            return None
        message, self.pending = self.pending, worker_pb2.SessionResponse()
        return message


def _deadline(time_remaining: float | None) -> float | None:
    """The call's deadline on `time.monotonic()`'s clock (None: the caller set none)."""
    return None if time_remaining is None else time.monotonic() + time_remaining


# How often a request that found no free blocks tries again (the pool frees blocks every step).
_RESERVE_RETRY_S = 0.005


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, model_name: str, kv_transport: str = "auto",
                 tracer: trace.Tracer | None = None, max_queued: int = 1024, tls: TlsConfig | None = None) -> None:
        # TLS (with this worker's certificate, for mutual TLS) on the calls to prefill workers.
        self.tls = tls
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.engine = engine
        # Backpressure: requests accepted but not yet running (waiting for blocks, for their pages, or to be
        # scheduled) are bounded; past the bound a new one is refused with RESOURCE_EXHAUSTED at once.
        self.max_queued = max_queued
        self.num_queued = 0
        # The process-wide tracer unless one is given (tests host several services in one process).
        self.traces = DecodeTraces(tracer or get_tracer("decode"))
        self.model_name = model_name
        self.kv_transport = kv_transport
        self.gpu_uuid = gpu_uuid(engine.engine.runner.device)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, PeerState] = {}
        self._pool: ExportedPool | None = None
        # Requests whose blocks a prefill worker may still be writing (cuda-ipc, cancelled mid-transfer).
        self.quarantined: set[str] = set()
        self._sessions: set[_Session] = set()
        self.draining = False

    async def Generate(self, request: worker_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """One request per call (the session's requests take the same path)."""
        # gRPC Python does not pass deadlines on: the Prefill call gets what is left of ours.
        responses = self._serve(request, _deadline(context.time_remaining()), context.invocation_metadata())
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SessionResponse]:
        """Many requests over one stream: each start runs as its own task (the same path as `Generate`);
        the new tokens of all of them go out together, as many as have come since the last message."""
        session = _Session()
        self._sessions.add(session)
        reader = asyncio.create_task(self._read_session(requests, session))
        try:
            while True:
                await session.ready.wait()
                session.ready.clear()
                if (message := session.take()) is not None:
                    yield message
                if not session.tasks and (self.draining or reader.done()):
                    return  # draining (or the gateway closed its side) and nothing left in flight
        finally:
            # The gateway went away (or the worker is stopping): every request of the session ends here,
            # each freeing its blocks as a cancelled Generate call would.
            reader.cancel()
            for task in list(session.tasks.values()):
                task.cancel()
            self._sessions.discard(session)

    async def _read_session(self, requests: AsyncIterator[worker_pb2.SessionRequest], session: _Session) -> None:
        try:
            async for message in requests:
                if message.WhichOneof("kind") == "start":
                    self._start_in_session(session, message.start)
                elif message.WhichOneof("kind") == "cancel":
                    task = session.tasks.get(message.cancel.request_id)
                    if task is not None:
                        task.cancel()
        finally:
            session.ready.set()

    def _start_in_session(self, session: _Session, start: worker_pb2.SessionStart) -> None:
        req_id = start.request.request_id
        if self.draining:
            session.fail(req_id, grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        elif req_id in session.tasks:
            session.fail(req_id, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_id: {req_id!r} is already in flight in this session")
        else:
            session.tasks[req_id] = asyncio.create_task(self._run_in_session(session, start))

    async def _run_in_session(self, session: _Session, start: worker_pb2.SessionStart) -> None:
        req_id = start.request.request_id
        timeout = start.timeout_s if start.timeout_s > 0 else None
        try:
            async with asyncio.timeout(timeout):
                responses = self._serve(start.request, _deadline(timeout), start.trace_context.items())
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        session.send(req_id, response)
        except TimeoutError:
            session.fail(req_id, grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded for {req_id}")
        except TandemError as error:
            session.fail(req_id, status_of(error), str(error))
        except grpc.aio.AioRpcError as error:  # a prefill worker's error that ends the request
            session.fail(req_id, error.code(), error.details() or "")
        except Exception as error:  # a bug: this request ends with INTERNAL, the session's others go on
            log.exception("decode request %s failed", req_id)
            session.fail(req_id, grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        finally:
            session.tasks.pop(req_id, None)
            session.ready.set()

    def drain(self) -> None:
        """Refuse new requests in sessions (UNAVAILABLE: the gateway goes elsewhere) and end each session
        once its requests are done, so that the server's drain is not held up by idle sessions."""
        self.draining = True
        for session in self._sessions:
            session.ready.set()

    async def _serve(self, request: worker_pb2.DecodeRequest, deadline: float | None,
                     trace_carrier: Iterable[tuple[str, str | bytes]] | None,
                     ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """`_generate` inside the request's `decode.generate` span (continuing the caller's trace), with
        backpressure and the latency metrics of the request as decode sees it."""
        arrival = time.perf_counter()
        req_id = request.request_id
        if self.num_queued >= self.max_queued:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            raise OverloadedError(f"decode worker has {self.num_queued} requests waiting (limit {self.max_queued})")
        span = self.traces.start(req_id, len(request.prompt_token_ids), trace_carrier)
        time_to_first_token_s, num_tokens = 0.0, 0
        self.num_queued += 1
        is_queued = True
        try:
            with ending(span):
                async with contextlib.aclosing(self._generate(request, deadline)) as responses:
                    async for response in responses:
                        if is_queued:
                            self.num_queued -= 1
                            is_queued = False
                        if num_tokens == 0:
                            time_to_first_token_s = time.perf_counter() - arrival
                        num_tokens += len(response.token_ids)
                        if response.finish_reason:
                            metrics.observe_latency(time_to_first_token_s, time.perf_counter() - arrival, num_tokens)
                        yield response
        finally:
            if is_queued:
                self.num_queued -= 1
            self.traces.finish(req_id)

    async def _generate(self, request: worker_pb2.DecodeRequest,
                        deadline: float | None = None) -> AsyncIterator[worker_pb2.DecodeResponse]:
        arrival = time.perf_counter()
        req_id = request.request_id
        prompt = list(request.prompt_token_ids)
        prior = list(request.output_token_ids)  # a resumed request's tokens, already with the client
        params = sampling_from_worker(request.sampling)
        events = self.engine.open_stream(req_id, num_already_sent=len(prior))
        try:
            remote_ok = False
            if request.prefill_address:
                remote_ok = await self._prefill_remotely(req_id, prompt, params, request.prefill_address, prior,
                                                         deadline)
            if not remote_ok:
                await self.engine.call(lambda e: e.add_request(req_id, prompt, params, output_token_ids=prior))
            first = True
            while True:
                event = await events.get()
                if isinstance(event, EngineFailure):
                    raise event
                assert isinstance(event, TokenEvent)
                self.traces.on_event(req_id, event)
                response = worker_pb2.DecodeResponse(
                    token_ids=event.token_ids, logprobs=event.logprobs,
                    finish_reason=finish_reason_to_proto(event.finish_reason) if event.finish_reason else 0)
                if first:
                    response.time_to_first_token_s = time.perf_counter() - arrival
                    response.num_local_prefill_tokens = event.num_local_prefill_tokens
                    metrics.LOCAL_PREFILL_TOKENS.inc(event.num_local_prefill_tokens)
                    first = False
                if event.finish_reason is not None:
                    # Counted before the last message goes out: the gateway cancels the call once it has it,
                    # and this generator may never resume after the `yield`.
                    metrics.REQUESTS.labels(status=event.finish_reason).inc()
                yield response
                if event.finish_reason is not None:
                    return
        finally:
            self.engine.close_stream(req_id)
            # Cancelled, failed or done: the request's blocks are free now (unless a peer may still write
            # into them: then they are freed once it has stopped).
            if req_id not in self.quarantined:
                self.engine.post(lambda e: e.abort(req_id))

    async def _prefill_remotely(self, req_id: str, prompt: list[int], params: SamplingParams,
                                address: str, prior: list[int], deadline: float | None = None) -> bool:
        """Reserve blocks, have the prefill worker fill them, take the first token; False if the prefill
        worker failed (the reservation is dropped, and the caller prefills locally)."""
        engine = self.engine
        with ending(self.traces.child(req_id, "decode.admission")) as admission:
            waited_from = time.perf_counter()
            while True:
                reserved: Request | None = await engine.call(lambda e: e.reserve(req_id, prompt, params, prior))
                if reserved is not None:
                    break
                await asyncio.sleep(_RESERVE_RETRY_S)
            admission.set_attributes({"tandem.queue_wait_s": time.perf_counter() - waited_from,
                                      "tandem.kv.blocks_reserved": len(reserved.block_ids)})
        request = reserved
        peer = await self._peer(address)
        try:
            transport = choose_transport(self.kv_transport, self.gpu_uuid, peer.gpu_uuid, peer.kv_transports,
                                         peer.failed_ipc)
        except ValueError as error:
            await engine.call(lambda e: e.abort(req_id))
            raise KVTransportError(str(error)) from None
        try:
            return await self._pull(request, prompt, params, address, peer, transport, deadline)
        except grpc.aio.AioRpcError as error:
            details = error.details() or ""
            if transport == CUDA_IPC and error.code() == grpc.StatusCode.FAILED_PRECONDITION and "cuda-ipc" in details:
                # Nothing was written: the open (or pool lookup) failed. Learn it and go by bytes instead.
                log.warning("cuda-ipc to %s failed (%s); using grpc", address, details)
                if "unknown pool" in details:
                    peer.has_handle = False
                else:
                    peer.failed_ipc = True
                return await self._pull(request, prompt, params, address, peer, GRPC, deadline)
            # A peer that refuses our layout (the gateway pairs by fingerprint, so this is a misconfiguration):
            # nothing was written; serve the request anyway by prefilling locally.
            log.error("prefill at %s refused %s: %s; prefilling locally", address, req_id, details)
            metrics.KV_TRANSFER_FAILURES.inc()
            await self._drop(req_id, address, False)
            return False

    async def _pull(self, request: Request, prompt: list[int], params: SamplingParams, address: str,
                    peer: PeerState, transport: str, deadline: float | None = None) -> bool:
        engine = self.engine
        req_id = request.req_id
        layout = engine.engine.layout
        target = None
        if transport == CUDA_IPC:
            pool = self._exported_pool()
            target = worker_pb2.KVTarget(pool_id=pool.pool_id, block_ids=request.block_ids,
                                         pool=None if peer.has_handle else pool.handle.to_proto())
        stub = worker_pb2_grpc.PrefillStub(self._channel(address))
        kv_span = self.traces.start_kv_transfer(req_id, transport, address)
        call = stub.Prefill(worker_pb2.PrefillRequest(
            request_id=req_id, prompt_token_ids=prompt, sampling=sampling_to_worker(params),
            layout=layout_to_proto(layout), target=target, output_token_ids=request.output_token_ids),
            metadata=inject_metadata(trace.set_span_in_context(kv_span)),
            timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        start = time.perf_counter()
        num_bytes = 0
        # cuda-ipc: from the request until the first token, the peer may be writing into our blocks.
        peer_may_write = target is not None
        try:
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "pages":
                    pages = message.pages
                    k, v = messages_to_pages(pages, layout)
                    num_bytes += page_bytes(pages, layout)
                    layer, block_start = pages.layer, pages.block_start
                    engine.post(lambda e, k=k, v=v, layer=layer, start=block_start:
                                e.write_pages(request, layer, start, k, v))
                elif kind == "layers_done":
                    peer.has_handle = True
                elif kind == "first_token":
                    # For cuda-ipc the peer synchronised before sampling: every page is in our pool now.
                    peer_may_write = False
                    first = message.first_token

                    def activate(e: Engine, token_id: int = first.token_id, logprob: float = first.logprob) -> None:
                        e.activate(request, token_id, logprob)
                        engine.publish(request)

                    await engine.call(activate)
                    if target is not None:
                        peer.has_handle = True
                        num_bytes = len(request.block_ids) * layout.block_bytes_per_layer * 2 * layout.num_layers
                    metrics.KV_TRANSFER_BYTES.inc(num_bytes)
                    metrics.KV_TRANSFER_SECONDS.observe(time.perf_counter() - start)
                    self.traces.kv_transferred(kv_span, num_bytes, layout.num_layers, time.perf_counter() - start)
                    return True
            raise ValueError("prefill stream ended without a first token")
        except (grpc.aio.AioRpcError, ValueError) as error:
            record_error(kv_span, error)  # whatever happens next (a fallback, or the error goes on)
            if deadline is not None and time.monotonic() >= deadline:
                # Our own deadline, not a broken peer: no time is left for a local prefill either.
                await self._drop(req_id, address, peer_may_write)
                peer_may_write = False
                raise DeadlineExceededError(f"deadline exceeded before {req_id} was prefilled") from None
            if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise  # the caller decides (cuda-ipc fallback, or a real layout mismatch)
            if isinstance(error, grpc.aio.AioRpcError) and not is_unreachable(error):
                await self._drop(req_id, address, peer_may_write)
                peer_may_write = False
                raise
            log.warning("prefill at %s failed for %s (%s); prefilling locally", address, req_id, error)
            metrics.KV_TRANSFER_FAILURES.inc()
            await self._drop(req_id, address, peer_may_write)
            peer_may_write = False
            return False
        finally:
            call.cancel()
            kv_span.end()
            if peer_may_write:
                # Cancelled mid-transfer: the blocks stay held until the writer has stopped.
                self.quarantined.add(req_id)
                asyncio.get_running_loop().create_task(self._drop(req_id, address, True))

    async def _drop(self, req_id: str, address: str, peer_may_write: bool) -> None:
        """Free a reservation; with cuda-ipc first make the prefill worker stop (and finish) its writes."""
        if peer_may_write:
            stub = worker_pb2_grpc.PrefillStub(self._channel(address))
            for attempt in range(10):
                try:
                    await stub.Release(worker_pb2.ReleaseRequest(request_id=req_id), timeout=5.0)
                    break
                except grpc.aio.AioRpcError as error:
                    if error.code() == grpc.StatusCode.UNAVAILABLE and attempt >= 2:
                        break  # the writer's process is gone, and its writes with it
                    await asyncio.sleep(0.2 * (attempt + 1))
            else:
                log.error("prefill %s never confirmed release of %s; freeing its blocks anyway", address, req_id)
        self.quarantined.discard(req_id)
        await self.engine.call(lambda e: e.abort(req_id))

    async def _peer(self, address: str) -> PeerState:
        peer = self._peers.get(address)
        if peer is None:
            peer = PeerState()
            stub = worker_pb2_grpc.PrefillStub(self._channel(address))
            try:
                info = await stub.Info(worker_pb2.InfoRequest(), timeout=2.0)
                peer.gpu_uuid, peer.kv_transports = info.gpu_uuid, list(info.kv_transports)
                self._peers[address] = peer
            except grpc.aio.AioRpcError:
                pass  # not cached: asked again next time
        return peer

    def _exported_pool(self) -> ExportedPool:
        if self._pool is None:
            self._pool = ExportedPool.of(self.engine.engine.runner.kv_cache.tensor)
        return self._pool

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = make_channel(address, tls=self.tls)
        return self._channels[address]

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.engine, "decode", self.model_name)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

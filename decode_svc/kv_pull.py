"""The decode side of the KV handoff: fill a request's reserved blocks from a prefill worker, then activate it.

Decode pulls through one server-streaming `Prefill.Prefill` call, so the handoff lives and dies with that
stream. Per prefill peer it remembers the GPU and transports the peer offered, whether the peer has mapped
this worker's pool (cuda-ipc) and whether mapping failed (then grpc from there on). Every outcome the caller
must act on is explicit: `True` (activated), `False` (compute the prompt here instead), or an error that ends
the request. With cuda-ipc a peer may still be writing into the blocks when the request is cancelled: they
are then quarantined until the peer confirms (`Prefill.Release`) that it has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from tandem.common.errors import (
    DeadlineExceededError,
    KVIntegrityError,
    KVTransportError,
    LayoutMismatchError,
    PoolOpenError,
    UnknownPoolError,
)
from tandem.common.sampling_params import SamplingParams
from tandem.decode_svc.tracing import DecodeTraces
from tandem.engine.engine import Engine
from tandem.serving import metrics
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.kv_ipc import CUDA_IPC, GRPC, ExportedPool, choose_transport, gpu_uuid
from tandem.serving.kv_transfer import (
    PREFILL_METHOD,
    PagesView,
    messages_to_pages,
    page_bytes,
    parse_prefill_response,
)
from tandem.serving.rpc import ChannelPool, is_peer_failure, remote_error
from tandem.serving.telemetry import inject_metadata, record_error
from tandem.serving.wire import layout_to_proto, sampling_to_worker
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Release: how often to ask a peer to confirm it stopped writing, and how long each ask may take.
_RELEASE_ATTEMPTS = 10
_RELEASE_TIMEOUT_S = 5.0
# A prefill call that never reached its peer (gRPC could not connect: nothing was sent, nothing written) is tried
# again this many times, each after waiting up to `_CONNECT_WAIT_S` for the channel to connect, before the prompt
# falls back to a local prefill: a registered prefill worker refused a first connection now and then in CI, and a
# restarting one does for a moment, where a local prefill costs decode's steps a whole prompt.
_CONNECT_RETRIES = 2
_CONNECT_WAIT_S = 1.0
# A request whose pages have landed but that shares blocks still in flight for others waits at most this long for
# them, then computes its prompt here: a guard against a stalled transfer of another request, not a tuning knob.
# Those transfers come from the same batch of the prefill worker as a rule (milliseconds apart), but a prompt's
# prefill on a CPU, or on another, busier prefill worker, can take seconds.
SHARED_PREFIX_MAX_WAIT_S = 5.0
# Prefill calls open at once to one prefill worker; more wait here, in arrival order. A worker's server takes at most
# `ServiceOptions.max_concurrent_streams` (256) streams per connection, and gRPC's client does not wait for a free
# one: past it each call is refused (UNAVAILABLE, REFUSED_STREAM) and its prompt was computed here as a failed
# transfer. Half of that leaves room for `Info` and `Release` on the same connection, and is still many batches of
# the prefill worker's token budget (32 prompts of 256 tokens fill an 8,192-token batch).
MAX_PULLS_PER_PEER = 128


@dataclass
class PeerState:
    """What this decode worker knows of one prefill worker."""

    gpu_uuid: str = ""
    kv_transports: list[str] = field(default_factory=lambda: [GRPC])
    has_handle: bool = False  # it has mapped our pool
    failed_ipc: bool = False  # it could not map it: grpc from now on
    unreachable: bool = False  # its Info went unanswered (not connected, or no answer in time): not cached
    slow: bool = False  # ... because it timed out (connected, but no answer in time)


@dataclass(frozen=True)
class PullRequest:
    """What a pull needs to know of the request (the engine's own Request stays on the engine thread)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    # Leading tokens whose blocks came from this worker's prefix cache: the prefill worker does not ship them.
    num_cached_tokens: int = 0


class _NotConnected(Exception):  # noqa: N818 - an outcome, not an error
    """The prefill call failed before it reached the peer (`_pull_from` tries it again)."""


class FallBackLocally(Exception):  # noqa: N818 - an outcome, not an error
    """The transfer failed in a way a local prefill gets past; `reason` labels the tokens computed here."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KVPuller:
    """Pulls prompts' pages from prefill workers into this decode worker's engine."""

    def __init__(self, engine: AsyncEngine, channels: ChannelPool, traces: DecodeTraces, kv_transport: str = "auto",
                 is_known_peer: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.engine = engine
        self.channels = channels
        self.traces = traces
        self.kv_transport = kv_transport
        # Decode dials only prefill workers it knows (the registry's, or the configured list); None: any.
        self.is_known_peer = is_known_peer
        self.gpu_uuid = gpu_uuid(engine.engine.runner.device)
        self._peers: dict[str, PeerState] = {}
        self._pull_slots: dict[str, asyncio.Semaphore] = {}  # by peer address: see MAX_PULLS_PER_PEER
        self._pool: ExportedPool | None = None
        # Requests whose blocks a peer may still be writing (cuda-ipc, cancelled mid-transfer).
        self.quarantined: set[str] = set()

    async def pull(self, request: PullRequest, address: str, deadline: float | None) -> None:
        """Fill `request`'s reserved blocks from the prefill worker at `address` and activate it with the first
        token. Raises FallBackLocally when the prompt should be computed here instead, and a TandemError (or a
        peer's gRPC error) that ends the request."""
        if self.is_known_peer is not None and not await self.is_known_peer(address):
            log.warning("%s: prefill worker %s is not in the registry; prefilling locally", request.req_id, address)
            raise FallBackLocally("unknown_prefill_worker")
        slots = self._pull_slots.get(address)
        if slots is None:
            slots = self._pull_slots[address] = asyncio.Semaphore(MAX_PULLS_PER_PEER)
        async with slots:
            await self._pull_from(request, address, deadline)

    async def _pull_from(self, request: PullRequest, address: str, deadline: float | None) -> None:
        peer = await self._peer(address)
        # An Info that found no connection tells nothing of the peer's GPU: ask again once connected, within the
        # request's deadline. One that timed out on a connected peer is not asked again (it would wait as long).
        for _ in range(_CONNECT_RETRIES):
            if not peer.unreachable or peer.slow or (deadline is not None and time.monotonic() >= deadline):
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.channels.get(address).channel_ready(), _wait_s(deadline))
            peer = await self._peer(address)
        connect_retries = _CONNECT_RETRIES
        if peer.unreachable:
            if self.kv_transport == CUDA_IPC:  # forced, and its GPU unknown: never downgraded to bytes
                log.warning("%s: prefill worker %s did not answer; prefilling locally", request.req_id, address)
                raise FallBackLocally("transfer_failed")
            # waited already: one call by bytes, whose failure is recorded before the fallback
            transport, connect_retries = GRPC, 0
        else:
            try:
                transport = choose_transport(self.kv_transport, self.gpu_uuid, peer.gpu_uuid, peer.kv_transports,
                                             peer.failed_ipc)
            except ValueError as error:
                raise KVTransportError(str(error)) from None
        for _ in range(3 + _CONNECT_RETRIES):  # also: an unknown pool (send the handle), a failed map (go by bytes)
            try:
                await self._pull_once(request, address, peer, transport, deadline,
                                      retry_unconnected=connect_retries > 0)
                return
            except _NotConnected:
                connect_retries -= 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.channels.get(address).channel_ready(), _CONNECT_WAIT_S)
            except UnknownPoolError:
                peer.has_handle = False
            except PoolOpenError as error:
                log.warning("cuda-ipc to %s failed (%s); using grpc", address, error)
                peer.failed_ipc = True
                transport = GRPC
        raise FallBackLocally("transfer_failed")

    async def _pull_once(self, request: PullRequest, address: str, peer: PeerState, transport: str,
                         deadline: float | None, retry_unconnected: bool = False) -> None:
        """One prefill call; with `retry_unconnected`, one that could not connect raises `_NotConnected` instead of
        falling back."""
        engine = self.engine
        req_id = request.req_id
        layout = engine.engine.layout
        target = None
        if transport == CUDA_IPC:
            pool = self._exported_pool()
            target = worker_pb2.KVTarget(pool_id=pool.pool_id, block_ids=request.block_ids,
                                         pool=None if peer.has_handle else pool.handle.to_proto())
        kv_span = self.traces.start_kv_transfer(req_id, transport, address)
        call = self.channels.get(address).unary_stream(
            PREFILL_METHOD, request_serializer=worker_pb2.PrefillRequest.SerializeToString,
            response_deserializer=parse_prefill_response)(
            worker_pb2.PrefillRequest(request_id=req_id, prompt_token_ids=request.prompt_token_ids,
                                      sampling=sampling_to_worker(request.params), layout=layout_to_proto(layout),
                                      target=target, output_token_ids=request.output_token_ids,
                                      num_cached_tokens=request.num_cached_tokens),
            metadata=inject_metadata(trace.set_span_in_context(kv_span)),
            timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        start = time.perf_counter()
        num_bytes = 0
        # cuda-ipc: from the call until the first token, the peer may be writing into our blocks.
        peer_may_write = target is not None
        try:
            async for message in call:
                if isinstance(message, PagesView) or message.WhichOneof("kind") == "pages":
                    pages = message if isinstance(message, PagesView) else message.pages
                    try:
                        k, v = messages_to_pages(pages, layout)
                    except ValueError as error:
                        metrics.KV_INTEGRITY_FAILURES.inc()
                        raise KVIntegrityError(str(error)) from None
                    num_bytes += page_bytes(pages, layout)
                    engine.post(lambda e, k=k, v=v, layer=pages.layer, start=pages.block_start:
                                e.write_pages(req_id, layer, start, k, v))
                elif message.WhichOneof("kind") == "first_token":
                    # The peer sampled it after its step wrote every page (the sample synchronised the step):
                    # with cuda-ipc the pages are in our pool now; with grpc, queued on the engine before this.
                    peer_may_write = False
                    first = message.first_token

                    def activate(e: Engine, token_id: int = first.token_id, logprob: float = first.logprob) -> bool:
                        activated = e.activate(req_id, token_id, logprob)  # with those that waited for it
                        for request_done in activated:
                            engine.publish(request_done)
                        return any(r.req_id == req_id for r in activated)

                    # May run while a decode step computes: the first token goes out without waiting for it.
                    if not await engine.call(activate, mid_step=True):
                        # It waits for requests whose blocks it shares (or computes its prompt here): bounded.
                        asyncio.get_running_loop().call_later(
                            SHARED_PREFIX_MAX_WAIT_S, engine.post, lambda e: e.expire_shared_wait(req_id))
                    if target is not None:
                        peer.has_handle = True
                        num_cached_blocks = request.num_cached_tokens // layout.block_size
                        num_bytes = (len(request.block_ids) - num_cached_blocks) * layout.block_bytes
                    metrics.KV_TRANSFER_BYTES.inc(num_bytes)
                    metrics.KV_TRANSFER_SECONDS.observe(time.perf_counter() - start)
                    self.traces.kv_transferred(kv_span, num_bytes, layout.num_layers, time.perf_counter() - start)
                    return
            raise KVIntegrityError("the prefill stream ended without a first token")
        except (grpc.aio.AioRpcError, KVTransportError) as error:
            record_error(kv_span, error)  # whatever happens next (a fallback, or the error goes on)
            typed = remote_error(error) if isinstance(error, grpc.aio.AioRpcError) else error
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"deadline exceeded before {req_id} was prefilled") from None
            if isinstance(typed, (UnknownPoolError, PoolOpenError)):
                raise typed from None  # refused before anything was written: `pull` retries
            if retry_unconnected and _never_connected(error):
                peer_may_write = False  # the call never reached the peer
                raise _NotConnected() from None
            if isinstance(typed, LayoutMismatchError):
                # The gateway pairs by fingerprint, so this is a misconfiguration; serve the request anyway.
                log.error("prefill at %s refused %s: %s; prefilling locally", address, req_id, typed)
                reason = "transfer_refused"
            elif isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAUTHENTICATED:
                # Not the stack's internal token (a misconfiguration, not the client's doing): serve it anyway.
                log.error("prefill at %s refused this worker: %s; prefilling locally", address, error.details())
                reason = "transfer_refused"
            elif isinstance(typed, KVTransportError) or (isinstance(error, grpc.aio.AioRpcError)
                                                         and is_peer_failure(error)):
                log.warning("prefill at %s failed for %s (%s); prefilling locally", address, req_id, error)
                reason = "transfer_failed"
            else:
                raise typed if typed is not None else error from None  # ends the request (e.g. INVALID_ARGUMENT)
            metrics.KV_TRANSFER_FAILURES.inc()
            engine.post(lambda e: e.withdraw(req_id))  # nobody new shares its blocks; sharers fail over now
            if peer_may_write:  # the blocks are reused for the local prefill: the writer must have stopped
                await self._stop_writer(req_id, address)
                peer_may_write = False
            raise FallBackLocally(reason) from None
        finally:
            call.cancel()
            kv_span.end()
            if peer_may_write:
                # Stopped mid-transfer (failed or cancelled): the blocks stay held until the writer has stopped.
                self.quarantined.add(req_id)
                engine.post(lambda e: e.withdraw(req_id))
                asyncio.get_running_loop().create_task(self._release(req_id, address))

    async def _stop_writer(self, req_id: str, address: str) -> None:
        """Return once the prefill worker has stopped writing the request's pages (`Prefill.Release`), or is
        gone, or never answers (then logged: the blocks are reused anyway)."""
        stub = worker_pb2_grpc.PrefillStub(self.channels.get(address))
        for attempt in range(_RELEASE_ATTEMPTS):
            try:
                await stub.Release(worker_pb2.ReleaseRequest(request_id=req_id), timeout=_RELEASE_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE and attempt >= 2:
                    return  # the writer's process is gone, and its writes with it
                await asyncio.sleep(0.2 * (attempt + 1))
        log.error("prefill %s never confirmed release of %s; freeing its blocks anyway", address, req_id)

    async def _release(self, req_id: str, address: str) -> None:
        """A quarantined request (its call ended while the peer may still write): free its blocks once the
        writer has stopped. The request's own clean-up skips the abort while it is quarantined."""
        try:
            await self._stop_writer(req_id, address)
        finally:
            self.quarantined.discard(req_id)
            await self.engine.call(lambda e: e.abort(req_id))

    async def connect(self, address: str, attempts: int = 120, interval_s: float = 0.5) -> bool:
        """Warm start: learn the peer (Info) and, when cuda-ipc will be used with it, have it map this worker's
        pool now (`OpenPool`), so the first request pays for neither. Retries while the peer is not up yet;
        False if it never answered or refused (the first request then does it)."""
        for _ in range(attempts):
            peer = await self._peer(address)
            if address in self._peers:
                break
            if not peer.unreachable:
                return False  # it answered with a refusal (another stack's token, say): the first request learns why
            await asyncio.sleep(interval_s)
        else:
            return False
        try:
            transport = choose_transport(self.kv_transport, self.gpu_uuid, peer.gpu_uuid, peer.kv_transports,
                                         peer.failed_ipc)
        except ValueError:
            return False
        if transport != CUDA_IPC or peer.has_handle:
            return True
        pool = self._exported_pool()
        try:
            await worker_pb2_grpc.PrefillStub(self.channels.get(address)).OpenPool(
                worker_pb2.OpenPoolRequest(pool_id=pool.pool_id, pool=pool.handle.to_proto(),
                                           layout=layout_to_proto(self.engine.engine.layout)), timeout=30.0)
            peer.has_handle = True
        except grpc.aio.AioRpcError as error:
            if isinstance(remote_error(error), PoolOpenError):
                log.warning("cuda-ipc to %s impossible (%s); using grpc", address, error.details())
                peer.failed_ipc = True
            else:
                return False
        return True

    async def _peer(self, address: str) -> PeerState:
        peer = self._peers.get(address)
        if peer is None:
            peer = PeerState()
            try:
                info = await worker_pb2_grpc.PrefillStub(self.channels.get(address)).Info(
                    worker_pb2.InfoRequest(), timeout=2.0)
                peer.gpu_uuid, peer.kv_transports = info.gpu_uuid, list(info.kv_transports)
                self._peers[address] = peer
            except grpc.aio.AioRpcError as error:  # not cached: asked again next time
                peer.unreachable = error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                peer.slow = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return peer

    def _exported_pool(self) -> ExportedPool:
        if self._pool is None:
            self._pool = ExportedPool.of(self.engine.engine.runner.kv_cache.tensor)
        return self._pool


def _wait_s(deadline: float | None) -> float:
    """How long to wait for a connection: _CONNECT_WAIT_S, less if the request's deadline comes first."""
    return _CONNECT_WAIT_S if deadline is None else max(0.0, min(_CONNECT_WAIT_S, deadline - time.monotonic()))


def _never_connected(error: BaseException) -> bool:
    """gRPC could not open a connection to the peer for this call: it was never sent."""
    return (isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
            and (error.details() or "").startswith("failed to connect"))

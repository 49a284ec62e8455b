"""How a prefill worker's pages leave it.

- cuda-ipc (the receiver's pool on this GPU): the pool is mapped once (`open_pool`, from a validated
  `CudaIpcPool`), and each request carries a `KVMirror` of its target blocks: the forward stores every layer's
  K/V there too, one more store per layer per pool, so nothing is copied afterwards and no host work is done per
  layer. The first token is sampled after the step's host sync, so its arrival proves the pages are in place.
- grpc (anywhere else): one hand-off per layer per step to the `PageExporter`, which copies the step's pages to
  pinned host memory on a side stream and writes the serialized messages on its own thread (the GIL released
  for the copies: the engine thread goes on launching); a request's first token waits for its own pages only
  (`exported`), not for those of a step launched behind its last (prefill pipelining).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.common.errors import InvalidRequestError, UnknownPoolError
from tandem.engine.attention import KVLayer
from tandem.engine.request import KVMirror, Request
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.kv_ipc import PoolHandle, open_pool
from tandem.serving.kv_transfer import PageExporter, WirePages
from tandem.v1 import worker_pb2


@dataclass
class PagesEvent:
    """One layer's pages of one request, already on the host and serialized (handed to the request's stream)."""

    layer: int
    messages: list[WirePages]


class PageExport:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # cuda-ipc: peers' pools mapped once, pool id → per-layer caches.
        self._pools: dict[str, list[KVLayer]] = {}
        self.exporter = PageExporter(engine.engine.runner.kv_cache.tensor)
        # Per request: a marker behind the last step that exported its pages (`exported`).
        self._exported: dict[str, Future[None]] = {}
        engine.engine.on_prefill_step = self.on_prefill_step

    def open_pool(self, pool_id: str, handle: PoolHandle) -> None:
        """Map a receiver's pool (raises PoolOpenError when it cannot be); a pool mapped already is kept."""
        if pool_id in self._pools:
            return
        engine = self.engine.engine
        pool = open_pool(handle, engine.layout, engine.runner.device)
        self._pools[pool_id] = [(pool[i, 0], pool[i, 1]) for i in range(pool.shape[0])]

    def mirror(self, target: worker_pb2.KVTarget) -> KVMirror:
        """Where a cuda-ipc request's pages go; maps the pool first if the target carries its handle."""
        if target.HasField("pool"):
            self.open_pool(target.pool_id, PoolHandle.from_proto(target.pool))
        layers = self._pools.get(target.pool_id)
        if layers is None:
            raise UnknownPoolError(f"cuda-ipc: unknown pool {target.pool_id}; send its handle")
        num_blocks = layers[0][0].shape[0]
        if any(b >= num_blocks for b in target.block_ids):
            raise InvalidRequestError("target.block_ids", f"a block id is outside the pool's {num_blocks} blocks")
        return KVMirror(layers, list(target.block_ids))

    def on_prefill_step(self, chunks: list[tuple[Request, int, int]]) -> Callable[[int], None] | None:
        """Engine thread, before a prefill step's forward: the per-layer hand-off of the blocks this step writes
        for the requests that go by bytes (None when every request of the step is mirrored). A prompt computed
        in chunks ships each block as it is written; a block a later chunk completes is sent again, whole."""
        block_size = self.engine.engine.config.cache.block_size
        exported = []
        for request, start, num_new in chunks:
            if request.kv_mirror is not None or not request.prefill_only:
                continue
            # From the first block the receiver lacks (on the request's first step that includes the blocks this
            # worker found in its own prefix cache and did not compute), to the last one this step writes.
            first = max(start // block_size, request.num_receiver_cached_tokens // block_size)
            if start == request.num_cached_tokens:
                first = request.num_receiver_cached_tokens // block_size
            end = -(-(start + num_new) // block_size)
            if end > first:
                exported.append((request.req_id, first, list(request.block_ids[first:end])))
        if not exported:
            return None
        on_layer = self.exporter.begin_step(exported, self._deliver)
        last_layer = self.engine.engine.layout.num_layers - 1
        req_ids = [req_id for req_id, _, _ in exported]

        def layer_done(layer: int) -> None:
            on_layer(layer)
            if layer == last_layer:
                # Done once this step's pages are delivered, not those of a step launched behind it (prefill
                # pipelining): what a request's first token waits for (`exported`).
                marker = self.exporter.flush()
                for req_id in req_ids:
                    self._exported[req_id] = marker

        return layer_done

    def exported(self, req_id: str) -> Future[None]:
        """Done once every page of `req_id` handed to the exporter so far is delivered (its stream has them)."""
        marker = self._exported.pop(req_id, None)
        return marker if marker is not None else self.exporter.flush()

    def forget(self, req_id: str) -> None:
        self._exported.pop(req_id, None)

    def _deliver(self, req_id: str, messages: list[WirePages]) -> None:
        """Exporter thread: one layer's messages of one request, to its stream."""
        if messages:
            self.engine.post_event(req_id, PagesEvent(messages[0].layer, messages))

    def close(self) -> None:
        self.exporter.close()

"""Who is up, where, with what model, how loaded: the worker registry the gateway routes with.

Two implementations of `Registry`: `StaticRegistry` (addresses from the command line, optionally probed)
and `RedisRegistry` (a key per worker with a TTL that the worker's heartbeat refreshes). `pick_pair`
chooses a compatible (prefill, decode) pair from what a registry reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tandem.common.errors import UnavailableError

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# JSON types accepted for WorkerRecord's field annotations (strings, under postponed annotations).
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker advertises: identity, compatibility (fingerprint) and load."""

    role: str  # "prefill" | "decode"
    address: str  # host:port of its gRPC server
    model: str
    # Model/KV layout fingerprint: only workers with equal fingerprints may exchange KV pages.
    # Empty means unknown (a static address not probed yet).
    fingerprint: str
    num_free_blocks: int
    num_total_blocks: int
    queue_depth: int
    worker_id: str
    updated_at: float  # time.time() when the record was produced
    # The limits the gateway enforces before routing (0: not known yet).
    max_model_len: int = 0
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Parses `to_json`'s output; unknown keys are ignored so that newer workers may add fields.

        Raises ValueError on malformed input or a missing field.
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a worker record must be a JSON object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name not in data:
                if field.default is not MISSING:
                    continue
                raise ValueError(f"worker record lacks {field.name}")
            value = data[field.name]
            # Checked here, at the trust boundary: a string where a count belongs would otherwise fail
            # later, inside pick_pair, on the gateway's request path.
            expected = _JSON_TYPES[str(field.type)]
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"worker record field {field.name} must be {field.type}, got {value!r}")
            values[field.name] = value
        return cls(**values)


class Registry(Protocol):
    """The live set of workers, as the gateway sees it. `workers` answers from memory, never blocks on I/O."""

    async def start(self) -> None:
        """Loads the first view and starts refreshing it in the background."""

    async def stop(self) -> None:
        """Stops the background refresh (and heartbeat, if any)."""

    def workers(self, role: str) -> list[WorkerRecord]:
        """The workers of `role` ("prefill" or "decode") believed up now."""


# Asks a worker at `address` (in `role`) to describe itself; returns None if it did not answer.
Probe = Callable[[str, str], Awaitable["WorkerRecord | None"]]


class StaticRegistry:
    """Workers given by address. Without a probe, every address is taken as up with unknown load and
    fingerprint; with one, records are refreshed every `refresh_s` and a worker that does not answer
    is left out until it answers again."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        probe: Probe | None = None,
        *,
        refresh_s: float = 1.0,
        probe_timeout_s: float = 1.0,
    ) -> None:
        self._probe = probe
        self._refresh_s = refresh_s
        self._probe_timeout_s = probe_timeout_s
        now = time.time()
        self._records: dict[tuple[str, str], WorkerRecord] = {
            (role, address): WorkerRecord(
                role=role, address=address, model="", fingerprint="", num_free_blocks=0, num_total_blocks=0,
                queue_depth=0, worker_id=f"{role}@{address}", updated_at=now,
            )
            for role, addresses in (("prefill", prefill_addresses), ("decode", decode_addresses))
            for address in addresses
        }
        self._down: set[tuple[str, str]] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._probe is None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever(), name="static-registry-refresh")

    async def stop(self) -> None:
        await _cancel(self._task)
        self._task = None

    def workers(self, role: str) -> list[WorkerRecord]:
        return [record for key, record in self._records.items() if key[0] == role and key not in self._down]

    async def refresh(self) -> None:
        """Probes every address once, concurrently, and updates records and up/down state."""
        if self._probe is None:
            return
        keys = list(self._records)
        results = await asyncio.gather(*(self._probe_one(role, address) for role, address in keys))
        for key, record in zip(keys, results, strict=True):
            if record is None:
                if key not in self._down:
                    log.warning("%s worker %s does not answer: left out until it does", *key)
                self._down.add(key)
                continue
            if key in self._down:
                log.info("%s worker %s answers again", *key)
                self._down.discard(key)
            self._records[key] = record

    async def _probe_one(self, role: str, address: str) -> WorkerRecord | None:
        assert self._probe is not None
        try:
            return await asyncio.wait_for(self._probe(role, address), self._probe_timeout_s)
        except (asyncio.TimeoutError, OSError):
            # A probe reports an unreachable worker by returning None; a hung or refused connection is
            # the same answer.
            return None

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()


class RedisRegistry:
    """Workers as they advertise themselves in Redis: one key per worker, `key_prefix + worker_id`,
    holding `WorkerRecord.to_json()` with a TTL of `ttl_s`.

    A worker calls `register`, whose heartbeat rewrites its key every `ttl_s / 3`; a worker that dies
    stops doing so and its key lapses. A reader (the gateway) calls `start`, which rescans the keys
    every `refresh_s` into an in-memory view (a scan, not pub/sub or keyspace events: those are lost on
    reconnect). While Redis is unreachable the last view is served and the heartbeat keeps trying, so a
    restarted Redis is repopulated by the next heartbeats; for one TTL after it answers again, workers
    missing from the scan stay in the view (they have not had the chance to re-register yet).
    """

    def __init__(
        self,
        url: str,
        key_prefix: str = "tandem:worker:",
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        *,
        timeout_s: float = 1.0,
    ) -> None:
        if ttl_s <= 0 or refresh_s <= 0:
            raise ValueError(f"ttl_s and refresh_s must be > 0, got {ttl_s} and {refresh_s}")
        self._key_prefix = key_prefix
        self._ttl_s = ttl_s
        self._refresh_s = refresh_s
        # No client-side retries: the heartbeat and refresh loops are the retry, on their own schedule, and
        # a call that fails fast keeps the last view served without delay.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._view: dict[str, WorkerRecord] = {}
        self._record_provider: Callable[[], WorkerRecord] | None = None
        self._registered_key: str | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._is_reachable = True
        # Until then (monotonic clock), records missing from a scan are kept: set when Redis comes back,
        # because a restarted Redis is empty until every worker's next heartbeat.
        self._keep_missing_until = 0.0
        self._unparsable_keys: set[str] = set()

    # -- reader side ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        self._reader_task = asyncio.create_task(self._refresh_forever(), name="redis-registry-refresh")

    async def stop(self) -> None:
        """Stops reading and heartbeating and closes the connection. The worker's key is left to lapse:
        call `deregister` first for a graceful exit."""
        await _cancel(self._reader_task)
        await _cancel(self._heartbeat_task)
        self._reader_task = self._heartbeat_task = None
        await self._redis.aclose()

    def workers(self, role: str) -> list[WorkerRecord]:
        return [record for record in self._view.values() if record.role == role]

    async def refresh(self) -> bool:
        """Rescans Redis into the view; on failure keeps the last view. Returns whether Redis answered."""
        try:
            keys = [key async for key in self._redis.scan_iter(match=_glob_escape(self._key_prefix) + "*")]
            values = await self._redis.mget(keys) if keys else []
        except (RedisError, OSError) as error:
            self._note_unreachable(error)
            return False
        self._note_reachable()
        view: dict[str, WorkerRecord] = {}
        if time.monotonic() < self._keep_missing_until:
            view.update(self._view)
        for key, value in zip(keys, values, strict=True):
            if value is None:  # lapsed between SCAN and MGET
                continue
            record = self._parse(key.decode(), value)
            if record is not None:
                view[record.worker_id] = record
        self._view = view
        return True

    def _parse(self, key: str, value: bytes | str) -> WorkerRecord | None:
        try:
            return WorkerRecord.from_json(value)
        except (ValueError, TypeError) as error:
            # One bad writer must not hide the others; warn once per key, not every refresh.
            if key not in self._unparsable_keys:
                self._unparsable_keys.add(key)
                log.warning("ignoring registry key %s: %s", key, error)
            return None

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    # -- worker side ---------------------------------------------------------------------------------

    async def register(self, record_provider: Callable[[], WorkerRecord]) -> None:
        """Advertises this worker until `deregister` or `stop`: writes `record_provider()` (stamped with
        the current time) now and every `ttl_s / 3` seconds. Redis being down is not an error: the
        heartbeat keeps trying and re-registers when it returns."""
        assert self._heartbeat_task is None, "register() called twice"
        self._record_provider = record_provider
        await self._heartbeat()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_forever(), name="redis-registry-heartbeat")

    async def deregister(self) -> None:
        """Stops the heartbeat and deletes the key, so readers stop routing here at their next refresh
        (graceful drain). If Redis is unreachable the key lapses after the TTL instead."""
        await _cancel(self._heartbeat_task)
        self._heartbeat_task = None
        if self._registered_key is None:
            return
        try:
            await self._redis.delete(self._registered_key)
        except (RedisError, OSError) as error:
            log.warning("could not delete %s (%s): it lapses in %.1f s", self._registered_key, error,
                        self._ttl_s)
        self._registered_key = None

    async def _heartbeat(self) -> None:
        assert self._record_provider is not None
        record = replace(self._record_provider(), updated_at=time.time())
        key = self._key_prefix + record.worker_id
        try:
            await self._redis.set(key, record.to_json(), px=max(1, round(self._ttl_s * 1000)))
        except (RedisError, OSError) as error:
            self._note_unreachable(error)
            return
        self._note_reachable()
        self._registered_key = key

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            await self._heartbeat()

    # -- reachability, logged on change only ---------------------------------------------------------

    def _note_unreachable(self, error: Exception) -> None:
        if self._is_reachable:
            self._is_reachable = False
            log.warning("Redis unreachable (%s): serving the last view of %d workers, retrying", error,
                        len(self._view))

    def _note_reachable(self) -> None:
        if not self._is_reachable:
            self._is_reachable = True
            self._keep_missing_until = time.monotonic() + self._ttl_s
            log.info("Redis reachable again: keeping the last view for %.1f s while workers re-register",
                     self._ttl_s)


def pick_pair(
    prefill: Sequence[WorkerRecord],
    decode: Sequence[WorkerRecord],
    fingerprint: str | None,
    *,
    rng: random.Random | None = None,
) -> tuple[WorkerRecord | None, WorkerRecord]:
    """Chooses where a request runs: the least loaded decode worker, and the least loaded prefill worker
    whose fingerprint equals that decode worker's.

    `fingerprint` (if not None) restricts both to workers of that model/KV layout. Decode load is free
    blocks relative to queue depth (more is better); prefill load is queue depth. Ties are broken at
    random so that equal workers share the traffic. Raises UnavailableError when no decode worker fits;
    the prefill worker is None when none fits, and decode then computes the prompt itself.
    """
    rng = rng or random.Random()
    decode = [w for w in decode if fingerprint is None or w.fingerprint == fingerprint]
    if not decode:
        suffix = "" if fingerprint is None else f" with fingerprint {fingerprint}"
        raise UnavailableError(f"no decode worker{suffix} is up")
    chosen_decode = _pick_min(decode, lambda w: -w.num_free_blocks / (1 + w.queue_depth), rng)
    prefill = [w for w in prefill if w.fingerprint == chosen_decode.fingerprint]
    chosen_prefill = _pick_min(prefill, lambda w: w.queue_depth, rng) if prefill else None
    return chosen_prefill, chosen_decode


def _pick_min(
    workers: Sequence[WorkerRecord], load: Callable[[WorkerRecord], Any], rng: random.Random
) -> WorkerRecord:
    lowest = min(load(w) for w in workers)
    return rng.choice([w for w in workers if load(w) == lowest])


def _glob_escape(text: str) -> str:
    """Escapes Redis glob metacharacters so a prefix matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    # Cancel until done: a library may swallow a cancellation (a refresh loop was once seen surviving its
    # cancel inside a redis-py call, under load), and stop() would then wait forever. wait() rather than
    # `await task`: the task's CancelledError is the one we asked for, while a cancellation of the caller
    # still propagates.
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)

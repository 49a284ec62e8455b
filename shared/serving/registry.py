"""Who is up, where, with what model, how loaded, what it caches: the worker registry the gateway routes with.

Two implementations of `Registry`: `StaticRegistry` (addresses from the command line, optionally probed)
and `RedisRegistry` (a key per worker with a TTL that the worker's heartbeat refreshes). `pick_pair`
chooses a compatible (prefill, decode) pair from what a registry reports, by load alone (the gateway's
cache-aware choice is `tandem.gateway.kv_routing`).

What a worker's prefix cache holds travels with its record as a `CacheSummary`, refreshed every
`CACHE_VIEW_INTERVAL_S`: through `Info` (the static registry probes each worker that often) or through a
binary key per worker in Redis next to its JSON record (written and read that often). So what the gateway
routes by is at most `CACHE_VIEW_INTERVAL_S` (Info) or twice that (Redis: a write, then a read) old, plus a
round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Protocol

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tandem.common.errors import UnavailableError
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# JSON types accepted for WorkerRecord's field annotations (strings, under postponed annotations).
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}
# How often a worker's cache summary (and load) reaches the gateway: the static registry's probe interval, and
# both the write and the read interval of the Redis keys.
CACHE_VIEW_INTERVAL_S = 0.25
# Probes in a row that time out before the static registry leaves a worker out (one that refuses or says it is not
# serving is left out at once).
DOWN_AFTER_LATE_PROBES = 3
# Cached blocks a worker publishes at most (8 bytes each: 512 KiB); past it, those in use and the most recently used.
MAX_SUMMARY_BLOCKS = 65536
PREFIX_BYTES = 8


@dataclass(frozen=True)
class CacheSummary:
    """A worker's prefix cache as routers see it (`PrefixCacheSummary` on the wire): the first 8 bytes of each
    cached block's hash, with what a router needs to hash a prompt alike (block size, hash key).

    8 bytes of a 32-byte sha256 name a block well enough to route by (a false match among 65,536 entries has odds
    of ~2^-48 per lookup, and costs only a worse choice); the worker itself matches full hashes.
    """

    block_size: int
    # The extra key the worker's block hashes are chained with (its KV layout's fingerprint).
    hash_key: bytes
    block_hash_prefixes: bytes  # PREFIX_BYTES per block, as `BlockPool.cached_hash_prefixes` makes them
    num_cached_blocks: int
    taken_at: float  # the worker's time.time()

    @cached_property
    def prefixes(self) -> frozenset[int]:
        """The prefixes as integers (`prefix_of`), built once per summary (~3 ms for 65,536 on the 2-core CPU)."""
        count = len(self.block_hash_prefixes) // PREFIX_BYTES
        return frozenset(struct.unpack(f"<{count}Q", self.block_hash_prefixes))

    def same_cache(self, other: CacheSummary | None) -> bool:
        """Whether `other` lists exactly the same blocks (then its parsed set can be kept)."""
        return (other is not None and other.block_size == self.block_size and other.hash_key == self.hash_key
                and other.block_hash_prefixes == self.block_hash_prefixes)

    def to_proto(self) -> worker_pb2.PrefixCacheSummary:
        return worker_pb2.PrefixCacheSummary(
            block_size=self.block_size, hash_key=self.hash_key, block_hash_prefixes=self.block_hash_prefixes,
            num_cached_blocks=self.num_cached_blocks, taken_at=self.taken_at)

    @classmethod
    def from_proto(cls, message: worker_pb2.PrefixCacheSummary) -> CacheSummary | None:
        """The summary a worker published, or None when it has no cache to route by (caching off, or a worker older
        than summaries). Raises ValueError on a malformed one."""
        if not message.hash_key:
            return None
        if message.block_size < 1 or len(message.block_hash_prefixes) % PREFIX_BYTES:
            raise ValueError(f"malformed prefix cache summary: block_size {message.block_size}, "
                             f"{len(message.block_hash_prefixes)} bytes of prefixes")
        return cls(message.block_size, message.hash_key, message.block_hash_prefixes, message.num_cached_blocks,
                   message.taken_at)

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheSummary | None:
        """Parses a Redis summary key's value (a serialized `PrefixCacheSummary`); ValueError if malformed."""
        message = worker_pb2.PrefixCacheSummary()
        try:
            message.ParseFromString(data)
        except DecodeError as error:
            raise ValueError(f"unparsable prefix cache summary: {error}") from None
        return cls.from_proto(message)


def prefix_of(block_hash: bytes) -> int:
    """A block hash as `CacheSummary.prefixes` lists it."""
    return int.from_bytes(block_hash[:PREFIX_BYTES], "little")


def _kept_cache(old: WorkerRecord | None, new: WorkerRecord) -> WorkerRecord:
    """`new`, holding `old`'s summary object when both list the same blocks: its parsed set is kept, and the
    gateway sees the cache as unchanged."""
    if old is not None and new.cache is not None and new.cache.same_cache(old.cache):
        return replace(new, cache=old.cache)
    return new


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker advertises: identity, compatibility (fingerprint), load, and what its prefix cache holds."""

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
    # What its prefix cache holds; None when unknown or off. Not in the JSON record: in Redis it has its own key,
    # refreshed more often (`RedisRegistry`).
    cache: CacheSummary | None = field(default=None, compare=False, repr=False, metadata={"json": False})

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in _json_fields()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Parses `to_json`'s output; unknown keys are ignored so that newer workers may add fields.

        Raises ValueError on malformed input or a missing field.
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a worker record must be a JSON object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for json_field in _json_fields():
            if json_field.name not in data:
                if json_field.default is not MISSING:
                    continue
                raise ValueError(f"worker record lacks {json_field.name}")
            value = data[json_field.name]
            # Checked here, at the trust boundary: a string where a count belongs would otherwise fail
            # later, inside pick_pair, on the gateway's request path.
            expected = _JSON_TYPES[str(json_field.type)]
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"worker record field {json_field.name} must be {json_field.type}, got {value!r}")
            values[json_field.name] = value
        return cls(**values)


def _json_fields() -> list[Any]:
    return [f for f in fields(WorkerRecord) if f.metadata.get("json", True)]


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


class _Late:
    """A probe that did not answer in time (what `StaticRegistry` counts toward `DOWN_AFTER_LATE_PROBES`)."""


class StaticRegistry:
    """Workers given by address. Without a probe, every address is taken as up with unknown load and
    fingerprint; with one, each worker's record is refreshed every `refresh_s` (on its own schedule, so a slow
    worker delays no other's) and a worker that does not answer is left out until it answers again."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        probe: Probe | None = None,
        *,
        refresh_s: float = CACHE_VIEW_INTERVAL_S,
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
        self._misses: dict[tuple[str, str], int] = {}  # probes in a row that timed out, by worker
        self._answered: set[tuple[str, str]] = set()  # workers that answered a probe once
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if self._probe is None:
            return
        await self.refresh()
        self._tasks = [asyncio.create_task(self._refresh_forever(key), name=f"static-registry-refresh-{key[1]}")
                       for key in self._records]

    async def stop(self) -> None:
        for task in self._tasks:
            await _cancel(task)
        self._tasks = []

    def workers(self, role: str) -> list[WorkerRecord]:
        return [record for key, record in self._records.items() if key[0] == role and key not in self._down]

    async def refresh(self) -> None:
        """Probes every address once, concurrently, and updates records and up/down state."""
        if self._probe is None:
            return
        keys = list(self._records)
        results = await asyncio.gather(*(self._probe_one(role, address) for role, address in keys))
        for key, record in zip(keys, results, strict=True):
            self._update(key, record)

    def _update(self, key: tuple[str, str], record: WorkerRecord | None | _Late) -> None:
        if isinstance(record, _Late):
            # A probe that times out may be this gateway's own busy event loop, not the worker: left out only
            # after DOWN_AFTER_LATE_PROBES in a row (a single one dropped the only worker of a loaded gateway).
            # A worker that never answered is out at once: all its record has is the address.
            self._misses[key] = self._misses.get(key, 0) + 1
            if self._misses[key] < DOWN_AFTER_LATE_PROBES and key in self._answered:
                return
            record = None
        if record is None:
            if key not in self._down:
                log.warning("%s worker %s does not answer: left out until it does", *key)
            self._down.add(key)
            return
        self._misses.pop(key, None)
        self._answered.add(key)
        if key in self._down:
            log.info("%s worker %s answers again", *key)
            self._down.discard(key)
        self._records[key] = _kept_cache(self._records[key], record)

    async def _probe_one(self, role: str, address: str) -> WorkerRecord | None | _Late:
        assert self._probe is not None
        try:
            return await asyncio.wait_for(self._probe(role, address), self._probe_timeout_s)
        except asyncio.TimeoutError:
            return _Late()
        except OSError:
            # A probe reports an unreachable or refusing worker by returning None; a refused connection is the
            # same answer.
            return None

    async def _refresh_forever(self, key: tuple[str, str]) -> None:
        # Every `refresh_s` from the start of the previous probe, not its end: the view's age stays bounded.
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at = max(next_at + self._refresh_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
            self._update(key, await self._probe_one(*key))


class RedisRegistry:
    """Workers as they advertise themselves in Redis: one key per worker, `key_prefix + worker_id`,
    holding `WorkerRecord.to_json()` with a TTL of `ttl_s`, and beside it `summary_prefix + worker_id`, holding
    its `CacheSummary` (a serialized `PrefixCacheSummary`, binary) with the same TTL. The summary has a key of its
    own so that the JSON record stays as it was (a gateway that predates summaries reads it unchanged, and
    never sees the binary keys: its scan matches `key_prefix` only).

    A worker calls `register`, whose heartbeat rewrites both keys every `CACHE_VIEW_INTERVAL_S` (or `ttl_s / 3`
    if shorter); a worker that dies stops doing so and its keys lapse. A reader (the gateway) calls `start`,
    which rescans the record keys every `refresh_s` into an in-memory view (a scan, not pub/sub or keyspace
    events: those are lost on reconnect) and, between scans, rereads the known workers' records and summaries
    with one MGET every `CACHE_VIEW_INTERVAL_S`. While Redis is unreachable the last view is served and the
    heartbeat keeps trying, so a restarted Redis is repopulated by the next heartbeats; for one TTL after it
    answers again, workers missing from a read stay in the view (they have not had the chance to re-register).
    """

    def __init__(
        self,
        url: str,
        key_prefix: str = "tandem:worker:",
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        *,
        timeout_s: float = 1.0,
        summary_prefix: str = "tandem:cache:",
        summary_interval_s: float = CACHE_VIEW_INTERVAL_S,
    ) -> None:
        if ttl_s <= 0 or refresh_s <= 0 or summary_interval_s <= 0:
            raise ValueError(f"ttl_s, refresh_s and summary_interval_s must be > 0, got {ttl_s}, {refresh_s} and "
                             f"{summary_interval_s}")
        if summary_prefix.startswith(key_prefix):
            raise ValueError(f"summary_prefix {summary_prefix!r} must not start with key_prefix {key_prefix!r}")
        self._key_prefix = key_prefix
        self._summary_prefix = summary_prefix
        self._ttl_s = ttl_s
        self._refresh_s = refresh_s
        self._summary_interval_s = summary_interval_s
        # No client-side retries: the heartbeat and refresh loops are the retry, on their own schedule, and
        # a call that fails fast keeps the last view served without delay.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._view: dict[str, WorkerRecord] = {}
        # The record keys the last scan found, reread between scans.
        self._known_keys: list[str] = []
        self._record_provider: Callable[[], WorkerRecord] | None = None
        self._registered_keys: tuple[str, str] | None = None
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
        """Stops reading and heartbeating and closes the connection. The worker's keys are left to lapse:
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
            keys = [key.decode() async for key in self._redis.scan_iter(match=_glob_escape(self._key_prefix) + "*")]
        except (RedisError, OSError) as error:
            self._note_unreachable(error)
            return False
        self._known_keys = keys
        return await self._read(keys)

    async def _read(self, keys: list[str]) -> bool:
        """Reads the records under `keys` and their summaries (one MGET) into the view."""
        summary_keys = [self._summary_prefix + key.removeprefix(self._key_prefix) for key in keys]
        try:
            values = await self._redis.mget(keys + summary_keys) if keys else []
        except (RedisError, OSError) as error:
            self._note_unreachable(error)
            return False
        self._note_reachable()
        view: dict[str, WorkerRecord] = {}
        if time.monotonic() < self._keep_missing_until:
            view.update(self._view)
        for key, value, summary in zip(keys, values[:len(keys)], values[len(keys):], strict=True):
            if value is None:  # lapsed, or deleted by a drain
                continue
            record = self._parse(key, value, summary)
            if record is not None:
                view[record.worker_id] = _kept_cache(self._view.get(record.worker_id), record)
        self._view = view
        return True

    def _parse(self, key: str, value: bytes | str, summary: bytes | str | None) -> WorkerRecord | None:
        try:
            record = WorkerRecord.from_json(value)
            # This client returns bytes (no decode_responses): None is a worker without a summary key.
            cache = CacheSummary.from_bytes(summary) if isinstance(summary, bytes) else None
        except (ValueError, TypeError) as error:
            # One bad writer must not hide the others; warn once per key, not every refresh.
            if key not in self._unparsable_keys:
                self._unparsable_keys.add(key)
                log.warning("ignoring registry key %s: %s", key, error)
            return None
        return replace(record, cache=cache)

    async def _refresh_forever(self) -> None:
        last_scan = time.monotonic()
        while True:
            await asyncio.sleep(min(self._summary_interval_s, self._refresh_s))
            if time.monotonic() - last_scan >= self._refresh_s:
                last_scan = time.monotonic()
                await self.refresh()
            else:
                await self._read(self._known_keys)

    # -- worker side ---------------------------------------------------------------------------------

    async def register(self, record_provider: Callable[[], WorkerRecord]) -> None:
        """Advertises this worker until `deregister` or `stop`: writes `record_provider()` (stamped with
        the current time), and its `cache` summary if it has one, now and every `CACHE_VIEW_INTERVAL_S`. Redis
        being down is not an error: the heartbeat keeps trying and re-registers when it returns."""
        assert self._heartbeat_task is None, "register() called twice"
        self._record_provider = record_provider
        await self._heartbeat()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_forever(), name="redis-registry-heartbeat")

    async def deregister(self) -> None:
        """Stops the heartbeat and deletes the keys, so readers stop routing here at their next refresh
        (graceful drain). If Redis is unreachable the keys lapse after the TTL instead."""
        await _cancel(self._heartbeat_task)
        self._heartbeat_task = None
        if self._registered_keys is None:
            return
        try:
            await self._redis.delete(*self._registered_keys)
        except (RedisError, OSError) as error:
            log.warning("could not delete %s (%s): they lapse in %.1f s", self._registered_keys, error,
                        self._ttl_s)
        self._registered_keys = None

    async def _heartbeat(self) -> None:
        assert self._record_provider is not None
        record = replace(self._record_provider(), updated_at=time.time())
        key = self._key_prefix + record.worker_id
        summary_key = self._summary_prefix + record.worker_id
        ttl_ms = max(1, round(self._ttl_s * 1000))
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(key, record.to_json(), px=ttl_ms)
                if record.cache is not None:
                    pipe.set(summary_key, record.cache.to_proto().SerializeToString(), px=ttl_ms)
                else:
                    pipe.delete(summary_key)
                await pipe.execute()
        except (RedisError, OSError) as error:
            self._note_unreachable(error)
            return
        self._note_reachable()
        self._registered_keys = (key, summary_key)

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self._ttl_s / 3, self._summary_interval_s))
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

"""shared/registry.py: RedisRegistry against a real redis-server, StaticRegistry with a fake probe,
and pick_pair."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from tandem.common.errors import UnavailableError
from tandem.serving.registry import (
    DOWN_AFTER_LATE_PROBES,
    RedisRegistry,
    StaticRegistry,
    WorkerRecord,
    pick_pair,
)

if TYPE_CHECKING:
    from tests.redis_server import RedisServer

# The redis_server fixture (imported as a plugin, so pytest rewrites its asserts too).
pytest_plugins = ["tests.redis_server"]

TTL_S = 1.0
REFRESH_S = 0.1


def record(worker_id: str, role: str = "decode", *, fingerprint: str = "fp", free: int = 100,
           queue: int = 0) -> WorkerRecord:
    return WorkerRecord(
        role=role, address=f"127.0.0.1:{abs(hash(worker_id)) % 60000 + 1}", model="smollm2-135m",
        fingerprint=fingerprint, num_free_blocks=free, num_total_blocks=128, queue_depth=queue,
        worker_id=worker_id, updated_at=0.0,
    )


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Polls `condition` until true; returns the seconds it took."""
    start = time.monotonic()
    while not await condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def worker_ids(registry: RedisRegistry, role: str) -> set[str]:
    return {w.worker_id for w in registry.workers(role)}


def redis_registry(server: RedisServer) -> RedisRegistry:
    return RedisRegistry(server.url, key_prefix="test:worker:", ttl_s=TTL_S, refresh_s=REFRESH_S,
                         timeout_s=0.5)


# -- WorkerRecord ----------------------------------------------------------------------------------------


def test_record_json_round_trip_ignores_unknown_fields() -> None:
    original = record("d0", queue=3)
    assert WorkerRecord.from_json(original.to_json()) == original
    assert WorkerRecord.from_json(original.to_json()[:-1] + ', "added_later": 1}') == original
    with pytest.raises(ValueError, match="lacks queue_depth"):
        WorkerRecord.from_json('{"role": "decode", "address": "a", "model": "m", "fingerprint": "f", '
                               '"num_free_blocks": 1, "num_total_blocks": 1, "worker_id": "w", '
                               '"updated_at": 0}')
    with pytest.raises(ValueError, match="queue_depth must be int"):
        WorkerRecord.from_json(original.to_json().replace('"queue_depth": 3', '"queue_depth": "3"'))
    with pytest.raises(ValueError, match="role"):
        replace(original, role="gateway")


# -- RedisRegistry ---------------------------------------------------------------------------------------


async def test_readers_see_registered_workers_and_their_load(redis_server: RedisServer) -> None:
    prefill, decode, reader = (redis_registry(redis_server) for _ in range(3))
    decode_load = {"queue": 0}
    await prefill.register(lambda: record("p0", "prefill"))
    await decode.register(lambda: record("d0", queue=decode_load["queue"]))
    await reader.start()
    try:
        assert await worker_ids(reader, "prefill") == {"p0"}
        assert await worker_ids(reader, "decode") == {"d0"}
        (seen,) = reader.workers("decode")
        assert seen.model == "smollm2-135m" and seen.fingerprint == "fp" and seen.num_free_blocks == 100
        assert abs(seen.updated_at - time.time()) < 5, "the heartbeat stamps the record"

        decode_load["queue"] = 7  # the heartbeat republishes the provider's current numbers

        async def sees_new_load() -> bool:
            return [w.queue_depth for w in reader.workers("decode")] == [7]

        await wait_until(sees_new_load, TTL_S * 2, "the new queue depth")
    finally:
        for registry in (prefill, decode, reader):
            await registry.stop()


async def test_worker_that_stops_heartbeating_lapses_after_ttl(redis_server: RedisServer) -> None:
    alive, dying, reader = (redis_registry(redis_server) for _ in range(3))
    await alive.register(lambda: record("d-alive"))
    await dying.register(lambda: record("d-dying"))
    await reader.start()
    try:
        assert await worker_ids(reader, "decode") == {"d-alive", "d-dying"}
        await dying.stop()  # like a crash: no deregister, the key must lapse on its own

        async def dropped() -> bool:
            return await worker_ids(reader, "decode") == {"d-alive"}

        took = await wait_until(dropped, TTL_S * 3, "the lapsed worker to drop out")
        assert took > TTL_S / 3, "dropped before its last heartbeat could have lapsed"
        await asyncio.sleep(TTL_S)  # well past the TTL: the live worker's heartbeat keeps it in
        assert await worker_ids(reader, "decode") == {"d-alive"}
    finally:
        for registry in (alive, reader):
            await registry.stop()


async def test_deregister_removes_the_worker_at_once(redis_server: RedisServer) -> None:
    worker, reader = redis_registry(redis_server), redis_registry(redis_server)
    await worker.register(lambda: record("d0"))
    await reader.start()
    try:
        assert await worker_ids(reader, "decode") == {"d0"}
        await worker.deregister()
        check = aioredis.Redis.from_url(redis_server.url)
        assert not await check.exists("test:worker:d0"), "the key is deleted, not left to lapse"
        await check.aclose()
        assert await reader.refresh()
        assert reader.workers("decode") == []
    finally:
        for registry in (worker, reader):
            await registry.stop()


async def test_redis_outage_keeps_the_last_view_and_workers_reregister(redis_server: RedisServer) -> None:
    prefill, decode, reader = (redis_registry(redis_server) for _ in range(3))
    await prefill.register(lambda: record("p0", "prefill"))
    await decode.register(lambda: record("d0"))
    await reader.start()
    try:
        redis_server.stop()
        await asyncio.sleep(TTL_S * 2)  # several failed heartbeats and refreshes, past every TTL
        assert await worker_ids(reader, "prefill") == {"p0"}, "the last view is served while Redis is down"
        assert await worker_ids(reader, "decode") == {"d0"}
        assert not await reader.refresh()

        redis_server.restart()  # empty: only new heartbeats can fill it
        check = aioredis.Redis.from_url(redis_server.url)

        async def reregistered() -> bool:
            return await check.exists("test:worker:p0", "test:worker:d0") == 2

        await wait_until(reregistered, TTL_S * 3, "the workers to re-register")
        await check.aclose()
        assert await reader.refresh()
        assert await worker_ids(reader, "decode") == {"d0"}
    finally:
        for registry in (prefill, decode, reader):
            await registry.stop()


async def test_redis_down_at_start_is_not_fatal(redis_server: RedisServer) -> None:
    redis_server.stop()
    worker, reader = redis_registry(redis_server), redis_registry(redis_server)
    await worker.register(lambda: record("d0"))
    await reader.start()
    try:
        assert reader.workers("decode") == []
        redis_server.start()

        async def seen() -> bool:
            return await worker_ids(reader, "decode") == {"d0"}

        await wait_until(seen, TTL_S * 3, "the worker once Redis is up")
    finally:
        for registry in (worker, reader):
            await registry.stop()


async def test_reader_ignores_malformed_keys(redis_server: RedisServer) -> None:
    check = aioredis.Redis.from_url(redis_server.url)
    await check.set("test:worker:junk", b"not json")
    await check.set("test:worker:d9", record("d9").to_json())
    await check.set("other:d8", record("d8").to_json())  # another prefix: not ours
    await check.aclose()
    reader = redis_registry(redis_server)
    await reader.start()
    try:
        assert await worker_ids(reader, "decode") == {"d9"}
    finally:
        await reader.stop()


# -- StaticRegistry --------------------------------------------------------------------------------------


async def test_static_registry_without_probe_lists_the_addresses() -> None:
    registry = StaticRegistry(["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"])
    await registry.start()
    assert [w.address for w in registry.workers("prefill")] == ["127.0.0.1:1"]
    assert [w.address for w in registry.workers("decode")] == ["127.0.0.1:2", "127.0.0.1:3"]
    assert all(w.fingerprint == "" for w in registry.workers("decode"))
    await registry.stop()


async def test_static_registry_probe_refreshes_load_and_marks_workers_down() -> None:
    answers: dict[str, WorkerRecord | None | Exception] = {
        "127.0.0.1:1": replace(record("p", "prefill"), address="127.0.0.1:1", queue_depth=2),
        "127.0.0.1:2": replace(record("d", "decode"), address="127.0.0.1:2"),
    }

    async def probe(role: str, address: str) -> WorkerRecord | None:
        answer = answers[address]
        if isinstance(answer, Exception):
            raise answer
        return answer

    registry = StaticRegistry(["127.0.0.1:1"], ["127.0.0.1:2"], probe, refresh_s=60.0)
    await registry.start()
    try:
        assert [w.queue_depth for w in registry.workers("prefill")] == [2]
        assert [w.fingerprint for w in registry.workers("decode")] == ["fp"]

        answers["127.0.0.1:1"] = None
        answers["127.0.0.1:2"] = ConnectionRefusedError()
        await registry.refresh()
        assert registry.workers("prefill") == [] and registry.workers("decode") == []

        answers["127.0.0.1:2"] = replace(record("d", "decode"), address="127.0.0.1:2", num_free_blocks=5)
        await registry.refresh()
        assert [w.num_free_blocks for w in registry.workers("decode")] == [5]
        assert registry.workers("prefill") == []
    finally:
        await registry.stop()


async def test_static_registry_hung_probe_of_a_worker_never_heard_counts_as_down() -> None:
    async def probe(role: str, address: str) -> WorkerRecord | None:
        await asyncio.sleep(60)
        return None

    registry = StaticRegistry([], ["127.0.0.1:2"], probe, probe_timeout_s=0.05)
    await registry.start()
    assert registry.workers("decode") == []
    await registry.stop()


async def test_static_registry_leaves_out_a_worker_after_several_late_probes_in_a_row() -> None:
    hung = False

    async def probe(role: str, address: str) -> WorkerRecord | None:
        if hung:
            await asyncio.sleep(60)
        return replace(record("d", "decode"), address=address)

    registry = StaticRegistry([], ["127.0.0.1:2"], probe, refresh_s=60.0, probe_timeout_s=0.05)
    await registry.start()
    hung = True
    await registry.refresh()
    try:
        # A late answer may be this gateway's own busy loop: one or two in a row keep the worker.
        for _ in range(DOWN_AFTER_LATE_PROBES - 1):
            assert [w.address for w in registry.workers("decode")] == ["127.0.0.1:2"]
            await registry.refresh()
        assert registry.workers("decode") == []  # hung: left out
        hung = False
        await registry.refresh()
        assert [w.address for w in registry.workers("decode")] == ["127.0.0.1:2"]
        hung = True  # the count starts again after an answer
        await registry.refresh()
        assert [w.address for w in registry.workers("decode")] == ["127.0.0.1:2"]
    finally:
        await registry.stop()


# -- pick_pair -------------------------------------------------------------------------------------------


def test_pick_pair_prefers_least_loaded_workers() -> None:
    decode = [record("d-busy", free=100, queue=9), record("d-idle", free=60), record("d-full", free=0)]
    prefill = [record("p-busy", "prefill", queue=4), record("p-idle", "prefill", queue=1)]
    chosen_prefill, chosen_decode = pick_pair(prefill, decode, "fp")
    assert chosen_decode.worker_id == "d-idle"
    assert chosen_prefill is not None and chosen_prefill.worker_id == "p-idle"


def test_pick_pair_respects_the_fingerprint() -> None:
    decode = [record("d-other", fingerprint="other", free=1000), record("d-fp", free=1)]
    prefill = [record("p-other", "prefill", fingerprint="other"), record("p-fp", "prefill", queue=50)]
    chosen_prefill, chosen_decode = pick_pair(prefill, decode, "fp")
    assert (chosen_prefill and chosen_prefill.worker_id, chosen_decode.worker_id) == ("p-fp", "d-fp")
    # Without a required fingerprint the prefill worker must still match the chosen decode worker.
    only_other = [record("d-other", fingerprint="x")]
    chosen_prefill, chosen_decode = pick_pair([record("p-fp", "prefill")], only_other, None)
    assert chosen_prefill is None and chosen_decode.worker_id == "d-other"


def test_pick_pair_without_decode_raises_and_without_prefill_decodes_locally() -> None:
    with pytest.raises(UnavailableError):
        pick_pair([record("p", "prefill")], [], None)
    with pytest.raises(UnavailableError, match="fingerprint fp"):
        pick_pair([], [record("d", fingerprint="other")], "fp")
    chosen_prefill, chosen_decode = pick_pair([], [record("d")], "fp")
    assert chosen_prefill is None and chosen_decode.worker_id == "d"


def test_pick_pair_breaks_ties_at_random() -> None:
    decode = [record(f"d{i}") for i in range(3)]
    prefill = [record(f"p{i}", "prefill") for i in range(3)]
    rng = random.Random(0)
    picks = [pick_pair(prefill, decode, "fp", rng=rng) for _ in range(200)]
    assert {d.worker_id for _, d in picks} == {"d0", "d1", "d2"}
    assert {p.worker_id for p, _ in picks if p is not None} == {"p0", "p1", "p2"}

"""The decode end of `Decode.Session` never ends a session before every update of its last requests went out:
a request that finishes while the writer is suspended in a write (the gateway reading slowly) still gets its
finish, also when the worker drains or the gateway closed its side. The runner is a stand-in for the engine (the
writer is what is under test); the real worker's drain is in tests/services/test_sessions.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.decode_svc.sessions import Sessions
from tandem.v1 import generation_pb2, worker_pb2


class TwoStepRunner:
    """Answers a request with one token, then, once `finish` is set, a last token and the finish."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()

    async def run(self, request: worker_pb2.DecodeRequest, deadline: float | None, trace_carrier: Any,
                  token_sink: Any = None, columns: Any = None) -> AsyncIterator[worker_pb2.DecodeResponse]:
        yield worker_pb2.DecodeResponse(token_ids=[7])
        await self.finish.wait()
        yield worker_pb2.DecodeResponse(token_ids=[8], finish_reason=generation_pb2.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("end", ["drain", "gateway_closes"])
async def test_a_request_that_finishes_during_a_write_still_gets_its_finish(end: str) -> None:
    runner = TwoStepRunner()
    sessions = Sessions(runner)  # type: ignore[arg-type]
    close_requests = asyncio.Event()

    async def requests() -> AsyncIterator[worker_pb2.SessionRequest]:
        yield worker_pb2.SessionRequest(start=worker_pb2.SessionStart(
            request=worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3])))
        await close_requests.wait()

    writer = sessions.serve(requests())
    first = await writer.__anext__()
    assert [list(u.response.token_ids) for u in first.updates] == [[7]]
    # The writer is suspended in its write of `first`; meanwhile the request ends and the session is told to end.
    if end == "drain":
        sessions.drain()
    else:
        close_requests.set()
    runner.finish.set()
    for _ in range(20):
        await asyncio.sleep(0)
    rest = [message async for message in writer]
    updates = [u for message in rest for u in message.updates]
    assert [list(u.response.token_ids) for u in updates] == [[8]]
    assert updates[-1].response.finish_reason == generation_pb2.FINISH_REASON_LENGTH

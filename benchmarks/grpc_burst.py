"""A burst of concurrent streaming calls on one connection: how many reach the handler, how many gRPC refuses.

    python -m tandem.benchmarks.grpc_burst --calls 1100,1500,2048 --out grpc-burst.json

Two ways gRPC answers a burst before any handler (or any limit of tandem's) sees a call:
- `backlog`: a server that takes as many streams per connection as the burst has, with gRPC core's own backlog
  limits (`core`) and with tandem's server options (`tandem`, `tandem.serving.rpc`). Core refuses calls that wait
  too long for grpc.aio's loop to take them (CANCELLED).
- `streams`: a server of `--stream-limit` streams per connection (tandem's workers take 256) and the burst: the
  client sends past the limit, and what is past it comes back refused (UNAVAILABLE, REFUSED_STREAM).
Each call streams 4 short messages, 2 ms apart, from a bare `Generation.Generate` handler in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc

from tandem.serving.rpc import server_options
from tandem.v1 import generation_pb2, generation_pb2_grpc


class _Handler(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.num_calls = 0

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.num_calls += 1
        for i in range(4):
            await asyncio.sleep(0.002)
            yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[i])


async def burst(num_calls: int, options: list[tuple[str, int]]) -> dict[str, Any]:
    """`num_calls` concurrent calls over one connection (made by a first call) to a server with `options`."""
    handler = _Handler()
    server = grpc.aio.server(options=options)
    generation_pb2_grpc.add_GenerationServicer_to_server(handler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = generation_pb2_grpc.GenerationStub(channel)

    async def one() -> str:
        try:
            async for _ in stub.Generate(generation_pb2.GenerateRequest(), timeout=60):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return "OK"

    try:
        assert await one() == "OK"
        outcomes = collections.Counter(await asyncio.gather(*(one() for _ in range(num_calls))))
    finally:
        await channel.close()
        await server.stop(0)
    return {"calls": num_calls, "outcomes": dict(outcomes), "handled": handler.num_calls - 1}


async def run(calls: list[int], stream_limit: int) -> list[dict[str, Any]]:
    rows = []
    for num_calls in calls:
        # As many streams per connection as the burst has: only the backlog can refuse.
        streams = [("grpc.max_concurrent_streams", num_calls)]
        tandem = [o for o in server_options(1 << 24, num_calls) if o[0].startswith("grpc.server.")]
        for name, options in (("core", streams), ("tandem", streams + tandem)):
            rows.append({"case": "backlog", "options": name, **await burst(num_calls, options)})
        rows.append({"case": "streams", "stream_limit": stream_limit,
                     **await burst(num_calls, server_options(1 << 24, stream_limit))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", default="1100,1500,2048", help="burst sizes")
    parser.add_argument("--stream-limit", type=int, default=256, help="the `streams` case's server limit")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(run([int(c) for c in args.calls.split(",")], args.stream_limit))
    if args.out is not None:
        args.out.write_text(json.dumps({
            "benchmark": "grpc_burst", "date": datetime.now(timezone.utc).isoformat(),
            "versions": {"grpcio": grpc.__version__, "python": platform.python_version()}, "rows": rows}, indent=1)
            + "\n")
    print(f"{'case':<8}{'server':<14}{'calls':>7}{'handled':>9}  outcomes")
    for row in rows:
        server = row.get("options") or f"{row['stream_limit']} streams"
        print(f"{row['case']:<8}{server:<14}{row['calls']:>7}{row['handled']:>9}  {row['outcomes']}")


if __name__ == "__main__":
    main()

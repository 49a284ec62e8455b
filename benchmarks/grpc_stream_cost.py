"""What one streamed gRPC message costs a grpc.aio server in CPU, with nothing else in the handler.

    python -m tandem.benchmarks.grpc_stream_cost --streams 256 --messages 64

A bare `Generation.Generate` handler (a subprocess) streams `--messages` small `GenerateResponse`s on each
of `--streams` concurrent calls from a client in this process; the server process's CPU time (Linux
/proc) divided by the messages sent is the floor under what the gateway pays per message to its clients.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc

from tandem.benchmarks.stack_overhead import cpu_seconds
from tandem.v1 import generation_pb2, generation_pb2_grpc


class _Streamer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, num_messages: int) -> None:
        self.num_messages = num_messages

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generation_pb2.GenerateResponse]:
        for i in range(self.num_messages):
            yield generation_pb2.GenerateResponse(request_id=request.request_id, text=" tok", token_ids=[i])
            await asyncio.sleep(0)  # let the other streams interleave, as a gateway's do


class _Writer(_Streamer):
    """The same messages through `context.write` instead of a generator (`--write`)."""

    async def Generate(self, request: generation_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> None:
        for i in range(self.num_messages):
            await context.write(generation_pb2.GenerateResponse(request_id=request.request_id, text=" tok",
                                                                token_ids=[i]))
            await asyncio.sleep(0)


async def _serve(num_messages: int, write: bool) -> None:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server((_Writer if write else _Streamer)(num_messages), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _load(port: int, num_streams: int) -> tuple[int, float]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]

    async def one(i: int) -> int:
        return len([r async for r in stubs[i % 4].Generate(generation_pb2.GenerateRequest(request_id=str(i)))])

    await asyncio.gather(*(one(i) for i in range(8)))  # warm-up
    start = time.perf_counter()
    num = sum(await asyncio.gather(*(one(i) for i in range(num_streams))))
    seconds = time.perf_counter() - start
    for channel in channels:
        await channel.close()
    return num, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--messages", type=int, default=64)
    parser.add_argument("--write", action="store_true", help="the handler calls context.write instead of yielding")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.messages, args.write))
        return
    command = [sys.executable, "-m", "tandem.benchmarks.grpc_stream_cost", "--serve", "--messages", str(args.messages)]
    server = subprocess.Popen(command + (["--write"] if args.write else []), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        before = cpu_seconds(server.pid)["process"]
        num, seconds = asyncio.run(_load(port, args.streams))
        cpu = cpu_seconds(server.pid)["process"] - before
    finally:
        server.terminate()
        server.wait()
    print(f"{num} messages on {args.streams} streams in {seconds:.2f} s; server CPU {cpu:.2f} s = "
          f"{cpu / num * 1e6:.0f} µs per message")


if __name__ == "__main__":
    main()

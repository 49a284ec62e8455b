"""The serve benchmark's load generator against a real grpc.aio server on loopback: its channels are connections of
their own. (gRPC shares one connection among channels with equal arguments, and `tandem gateway --workers N` spreads
connections, not streams, over its processes: one shared connection put a load-generator process's every stream on
one gateway process.)"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc

from tandem.benchmarks.serve import LengthDist, run_rate
from tandem.serving.rpc import start_server
from tandem.v1 import generation_pb2, generation_pb2_grpc


class _Peers(generation_pb2_grpc.GenerationServicer):
    """Streams two tokens and notes the client connection (its address) of every call."""

    def __init__(self) -> None:
        self.peers: list[str] = []

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.peers.append(context.peer())
        yield generation_pb2.GenerateResponse(token_ids=[1])
        yield generation_pb2.GenerateResponse(token_ids=[2], finish_reason=generation_pb2.FINISH_REASON_LENGTH)


async def test_each_channel_of_the_load_generator_is_a_connection() -> None:
    servicer = _Peers()

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return ["tandem.v1.Generation"]

    server, port, _ = await start_server("127.0.0.1:0", register)
    try:
        result = await run_rate(f"127.0.0.1:{port}", math.inf, 12, LengthDist.parse("fixed:4"),
                                LengthDist.parse("fixed:2"), seed=0, timeout=30, num_channels=3)
    finally:
        await server.stop(None)
    assert result["num_ok"] == 12 and not result["errors"]
    assert len(servicer.peers) == 12
    assert len(set(servicer.peers)) == 3  # one client port per channel, four calls on each

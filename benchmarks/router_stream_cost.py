"""What the gateway's own Python costs per streamed message, without gRPC on either side.

    python -m tandem.benchmarks.router_stream_cost --streams 256 --tokens 256 --repeat 5

`--streams` requests go through the gateway's real `Router.stream` (limits, admission, detokenization, progress,
stop strings) over a session that stands in for a decode worker's: every step it hands each running request one
token, the first and last in updates and the rest through `RequestUpdates.put_token` (the message columns of a real
session), then lets the readers run; each reader builds a `GenerateResponse` as the servicer does. The process's
CPU time per client message is what `tandem.benchmarks.grpc_stream_cost` (gRPC's own per message) leaves out of
the gateway's cost. The session's part (a token put per request per step) is in it too, as it is in a gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tandem.common.sampling_params import SamplingParams
from tandem.gateway.router import Router
from tandem.gateway.server import load_gateway_model
from tandem.gateway.sessions import RequestUpdates, StreamPacer
from tandem.serving.registry import WorkerRecord
from tandem.v1 import generation_pb2, worker_pb2


class _OneDecodeWorker:
    def __init__(self, model: str) -> None:
        self.model = model

    def workers(self, role: str) -> list[WorkerRecord]:
        if role != "decode":
            return []
        return [WorkerRecord(role="decode", address="bench:1", model=self.model, fingerprint="", num_free_blocks=1,
                             num_total_blocks=1, queue_depth=0, worker_id="bench", updated_at=0.0)]


class _StepSession:
    """A decode worker's session reduced to its requests' `RequestUpdates`, fed by `step()`."""

    closed = False

    def __init__(self) -> None:
        self.running: dict[str, tuple[RequestUpdates, list[int]]] = {}  # id → (updates, [tokens sent, max])

    def start(self, request: worker_pb2.DecodeRequest, timeout_s: float | None, trace_context: Any = None,
              stream_interval: int = 1, pacer: StreamPacer | None = None) -> RequestUpdates:
        updates = RequestUpdates(stream_interval, slot=1, pacer=pacer)
        self.running[request.request_id] = (updates, [0, request.sampling.max_tokens])
        return updates

    def finish(self, request_id: str, cancel: bool) -> None:
        self.running.pop(request_id, None)

    def step(self) -> None:
        for request_id, (updates, state) in list(self.running.items()):
            token_id = 1000 + (state[0] * 7 + len(request_id)) % 5000
            if 0 < state[0] < state[1] - 1:
                updates.put_token(token_id, -1.0)
            else:
                response = worker_pb2.DecodeResponse(token_ids=[token_id], logprobs=[-1.0])
                if state[0] == state[1] - 1:
                    response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                updates.put(worker_pb2.SessionUpdate(request_id=request_id, response=response))
            state[0] += 1

    async def close(self) -> None:
        pass


class _BenchRouter(Router):
    def __init__(self, model: str, max_model_len: int) -> None:
        gateway_model = load_gateway_model(model, max_model_len)
        super().__init__(gateway_model, _OneDecodeWorker(gateway_model.name))  # type: ignore[arg-type]
        self.session = _StepSession()

    def _session(self, address: str) -> Any:
        return self.session


async def run_once(router: _BenchRouter, num_streams: int, num_tokens: int) -> dict[str, float]:
    num_messages = 0

    async def read(i: int) -> None:
        nonlocal num_messages
        request_id = f"r{i}"
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        async for new_ids, text, progress in router.stream(request_id, [100 + i, 200, 300, 400], params):
            response = generation_pb2.GenerateResponse(request_id=request_id, text=text, token_ids=new_ids)
            if progress.finish_reason is not None:
                response.usage.completion_tokens = len(progress.token_ids)
            num_messages += 1

    readers = [asyncio.ensure_future(read(i)) for i in range(num_streams)]
    while len(router.session.running) < num_streams:
        failed = [r for r in readers if r.done()]
        if failed:
            await failed[0]  # raises what ended it early
            raise RuntimeError("a request ended before its first token")
        await asyncio.sleep(0)
    cpu = time.process_time()
    while router.session.running:
        router.session.step()
        for _ in range(3):  # the readers' wake-ups, then their next waits
            await asyncio.sleep(0)
    await asyncio.gather(*readers)
    cpu = time.process_time() - cpu
    return {"cpu_us_per_message": cpu / num_messages * 1e6,
            "messages_per_token": num_messages / (num_streams * num_tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny", help="whose tokenizer detokenizes (no weights are loaded)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    router = _BenchRouter(args.model, max_model_len=args.tokens + 64)
    runs = []
    for i in range(args.repeat):
        runs.append(asyncio.run(run_once(router, args.streams, args.tokens)))
        print(f"run {i + 1}/{args.repeat}: {runs[-1]['cpu_us_per_message']:.2f} µs CPU per message "
              f"({runs[-1]['messages_per_token']:.2f} per token)", flush=True)
    median = statistics.median(r["cpu_us_per_message"] for r in runs)
    print(f"router stream cost ({args.streams} streams x {args.tokens} tokens): {median:.2f} µs CPU per message "
          f"(median of {args.repeat})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "router_stream_cost", "label": args.label, "args": vars(args) | {"out": str(args.out)},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "runs": runs,
            "cpu_us_per_message_median": median}, indent=1))


if __name__ == "__main__":
    main()

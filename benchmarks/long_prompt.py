"""One very long prompt arriving while many streams decode: its TTFT, and what it does to their inter-token latency.

    python -m tandem.benchmarks.long_prompt --model dummy:llama-3.1-8b --device cuda --long-prompt 32768 \\
        --streams 64 --out long-prompt.json
    python -m tandem.benchmarks.long_prompt --stack-args=--no-chunked-prefill ...   # the same without chunking

A colocated stack (`tandem up --prefill 0`) serves `--streams` requests (short prompts, long outputs); once every
one of them streams, the long prompt is sent. Reported: the long prompt's TTFT, and the gaps between the streams'
token messages while it is being prefilled (from its arrival to its first token) against the gaps before it; the
target is an ITL p99 below 100 ms during the long prefill (chunked prefill interleaves decode tokens with chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import time
from pathlib import Path
from typing import Any

import grpc

from tandem.benchmarks.serve import percentiles
from tandem.benchmarks.serve_modes import running_stack
from tandem.v1 import generation_pb2, generation_pb2_grpc


class Stream:
    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.error: str | None = None


async def stream(stub: generation_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int, record: Stream,
                 timeout: float) -> None:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    try:
        async for response in stub.Generate(request, timeout=timeout):
            if response.token_ids:
                record.arrivals.append(time.perf_counter())
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.CANCELLED:
            record.error = f"{error.code().name}: {error.details()}"


def gaps(records: list[Stream], start: float, end: float) -> list[float]:
    """Gaps between consecutive token messages of each stream that overlap [start, end] (a step that stalls every
    stream through the whole window shows up as one gap ending after it)."""
    out = []
    for record in records:
        for earlier, later in zip(record.arrivals, record.arrivals[1:], strict=False):
            if later >= start and earlier <= end:
                out.append(later - earlier)
    return out


async def measure(address: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                          ("grpc.max_send_message_length", 64 << 20)])
    stub = generation_pb2_grpc.GenerationStub(channel)
    records = [Stream() for _ in range(args.streams)]
    tasks = [asyncio.create_task(stream(stub, [rng.randrange(10, 30000) for _ in range(args.stream_prompt)],
                                        args.stream_tokens, record, 600.0)) for record in records]
    deadline = time.monotonic() + 300
    while any(len(r.arrivals) < 2 for r in records):
        if time.monotonic() > deadline or any(r.error for r in records) or all(t.done() for t in tasks):
            raise SystemExit(f"the streams did not all start: {[r.error for r in records if r.error][:3]}")
        await asyncio.sleep(0.05)
    await asyncio.sleep(args.settle)
    long = Stream()
    sent = time.perf_counter()
    await stream(stub, [rng.randrange(10, 30000) for _ in range(args.long_prompt)], args.long_tokens, long, 600.0)
    if long.error or not long.arrivals:
        raise SystemExit(f"the long prompt failed: {long.error}")
    first = long.arrivals[0]
    await asyncio.sleep(args.settle)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    during, before = gaps(records, sent, first), gaps(records, sent - args.settle, sent)
    result = {"long_prompt_tokens": args.long_prompt, "long_ttft_s": first - sent, "streams": args.streams,
              "stream_prompt_tokens": args.stream_prompt, "itl_during_long_prefill_s": percentiles(during),
              "itl_max_during_long_prefill_s": max(during) if during else None,
              "itl_before_s": percentiles(before), "num_gaps_during": len(during),
              "stream_errors": [r.error for r in records if r.error]}
    p99 = result["itl_during_long_prefill_s"]["p99"]
    result["itl_p99_during_below_100ms"] = p99 is not None and p99 < 0.1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--long-prompt", type=int, default=32768)
    parser.add_argument("--long-tokens", type=int, default=8)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-prompt", type=int, default=128)
    parser.add_argument("--stream-tokens", type=int, default=4096, help="long enough to outlast the long prefill")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of steady decoding before the long prompt")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--stack-args", default="", help="more `tandem up` flags, e.g. --no-chunked-prefill")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    max_model_len = max(args.long_prompt + args.long_tokens, args.stream_prompt + args.stream_tokens) + 16
    extra = ["--max-model-len", str(max_model_len), *shlex.split(args.stack_args)]
    with running_stack("colocated", args.model, args.device, args.max_num_seqs, extra, args.out) as (address, _, _):
        result = asyncio.run(measure(address, args))
    result.update(model=args.model, device=args.device, stack_args=extra)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    during, before = result["itl_during_long_prefill_s"], result["itl_before_s"]
    worst = result["itl_max_during_long_prefill_s"]
    print(f"long prompt {args.long_prompt} tokens: TTFT {result['long_ttft_s'] * 1e3:.0f} ms; stream ITL p50/p99 "
          f"before {before['p50'] * 1e3:.1f}/{before['p99'] * 1e3:.1f} ms, during its prefill "
          f"{during['p50'] * 1e3:.1f}/{during['p99'] * 1e3:.1f} ms (max {worst * 1e3:.0f})"
          if worst is not None and before["p50"] is not None else f"no gaps measured: {result}")


if __name__ == "__main__":
    main()

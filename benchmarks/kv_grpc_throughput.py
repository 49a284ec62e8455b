"""The `grpc` KV transport alone: a prompt's pages from one process's pool into another's, as GB/s.

    python -m tandem.benchmarks.kv_grpc_throughput --tokens 1024,4096 --out kv-grpc.json

The sending process is a Prefill server whose handler computes nothing: it ships the pages of a pool of
the chosen model's KV shape (default Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16, 128 KiB per token)
layer by layer through the prefill service's own path (`PageExporter`: device→host, CRC32, chunked messages
written in the wire format, its serializer), then a first token. The receiver is decode's path
(`parse_prefill_response`: views of the received bytes, `messages_to_pages`: CRC check, on the event loop) and
the write into its own pool by `KVCache.write_blocks` on one other thread, as decode's engine thread does it
(`engine.post`). Time runs from the call to the first token and the last write, as the `kv.transfer` span and
the engine's queue see it ("receiver busy": the event loop's share; "writer busy": the pool writes; "export
alone": the exporter making every message in this process with nothing else running). On a GPU
(`--device cuda`) both pools live on it; on the CPU this is the transport's host cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from tandem.engine.kv_cache import KVCache
from tandem.models import load_model_config
from tandem.prefill_svc.servicer import add_to_server
from tandem.serving.kv_transfer import (
    PREFILL_METHOD,
    PageExporter,
    PagesView,
    WirePages,
    messages_to_pages,
    page_bytes,
    parse_prefill_response,
)
from tandem.serving.rpc import make_channel, start_server
from tandem.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16


def pool_for(model: str, num_tokens: int, device: str) -> tuple[torch.Tensor, int]:
    """A pool [layers, 2, blocks, block_size, kv_heads, head_dim] of random bf16 pages, and its block count."""
    config = load_model_config(model, fetch=False)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    shape = (config.num_hidden_layers, 2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return torch.randn(shape, device=device).to(torch.bfloat16), num_blocks


class _Sender(worker_pb2_grpc.PrefillServicer):
    def __init__(self, model: str, device: str) -> None:
        self.model, self.device = model, device
        self.pools: dict[int, tuple[torch.Tensor, int]] = {}  # by prompt length: made once, outside the timing

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse | bytes]:
        num_tokens = len(request.prompt_token_ids)
        if num_tokens not in self.pools:
            self.pools[num_tokens] = pool_for(self.model, num_tokens, self.device)
        pool, num_blocks = self.pools[num_tokens]
        exporter = PageExporter(pool)
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue[list[WirePages]] = asyncio.Queue()
        layer_done = exporter.begin_step([("kv", 0, list(range(num_blocks)))], lambda _, messages: (
            loop.call_soon_threadsafe(ready.put_nowait, messages)))
        for layer in range(pool.shape[0]):
            layer_done(layer)
        for _ in range(pool.shape[0]):
            for message in await ready.get():
                yield message.data
        exporter.close()
        # When the sender had made (and handed to gRPC) every message: the receiver splits its time by it.
        context.set_trailing_metadata((("x-sent-s", f"{time.perf_counter() - start:.6f}"),))
        yield worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(token_id=1))


def _export_alone(pool: torch.Tensor, num_blocks: int) -> float:
    """Seconds for the `PageExporter` to make every message of the pool's pages (no gRPC, nothing else running):
    the sender's own share of the transport."""
    exporter = PageExporter(pool)
    start = time.perf_counter()
    layer_done = exporter.begin_step([("kv", 0, list(range(num_blocks)))], lambda _, messages: None)
    for layer in range(pool.shape[0]):
        layer_done(layer)
    exporter.flush().result()
    seconds = time.perf_counter() - start
    exporter.close()
    return seconds


async def _serve(model: str, device: str) -> None:
    def add(server: grpc.aio.Server) -> list[str]:
        add_to_server(_Sender(model, device), server)
        return ["tandem.v1.Prefill"]

    server, port, _ = await start_server("127.0.0.1:0", add)
    print(port, flush=True)
    await server.wait_for_termination()


async def _receive(port: int, model: str, num_tokens: int, device: str) -> dict[str, float]:
    config = load_model_config(model, fetch=False)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    cache = KVCache(config, BLOCK_SIZE, num_blocks, torch.bfloat16, torch.device(device))
    layout = cache.layout
    # Decode's engine thread, which writes the pages (`Engine.write_pages`) while its event loop receives more.
    writer = ThreadPoolExecutor(1, thread_name_prefix="engine")
    writes: list[float] = []

    def write(layer: int, block_start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        began = time.perf_counter()
        cache.write_blocks(layer, list(range(block_start, block_start + k.shape[0])), k, v)
        writes.append(time.perf_counter() - began)

    channel = make_channel(f"127.0.0.1:{port}")
    prefill = channel.unary_stream(PREFILL_METHOD, request_serializer=worker_pb2.PrefillRequest.SerializeToString,
                                   response_deserializer=parse_prefill_response)
    start = time.perf_counter()
    num_bytes = 0
    busy = 0.0
    call = prefill(worker_pb2.PrefillRequest(request_id="kv", prompt_token_ids=[0] * num_tokens))
    async for pages in call:
        if isinstance(pages, PagesView):
            began = time.perf_counter()
            k, v = messages_to_pages(pages, layout)
            writer.submit(write, pages.layer, pages.block_start, k, v)
            num_bytes += page_bytes(pages, layout)
            busy += time.perf_counter() - began
    writer.shutdown(wait=True)  # the first token activates the request only after the writes queued before it
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    sent = dict(await call.trailing_metadata() or ()).get("x-sent-s")
    await channel.close()
    return {"tokens": num_tokens, "bytes": num_bytes, "seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9,
            "receiver_busy_s": busy, "writer_busy_s": sum(writes),
            "sender_done_s": float(sent) if sent else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the sending subprocess
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.model, args.device))
        return
    sender = subprocess.Popen([sys.executable, "-m", "tandem.benchmarks.kv_grpc_throughput", "--serve",
                               "--model", args.model, "--device", args.device], stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        assert sender.stdout is not None
        port = int(sender.stdout.readline())
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            asyncio.run(_receive(port, args.model, num_tokens, args.device))  # the sender makes its pool
            runs = [asyncio.run(_receive(port, args.model, num_tokens, args.device)) for _ in range(args.repeat)]
            best = statistics.median(r["seconds"] for r in runs)
            busy = statistics.median(r["receiver_busy_s"] for r in runs)
            written = statistics.median(r["writer_busy_s"] for r in runs)
            sent = statistics.median(r["sender_done_s"] for r in runs)
            pool, num_blocks = pool_for(args.model, num_tokens, args.device)
            _export_alone(pool, num_blocks)  # staging buffers, first touches
            export = statistics.median(_export_alone(pool, num_blocks) for _ in range(args.repeat))
            del pool
            rows.append({"tokens": num_tokens, "bytes": runs[0]["bytes"], "median_s": best,
                         "gb_per_s": runs[0]["bytes"] / best / 1e9, "runs_s": [r["seconds"] for r in runs],
                         "receiver_busy_median_s": busy, "writer_busy_median_s": written,
                         "sender_done_median_s": sent, "export_alone_median_s": export})
            print(f"{num_tokens:>6} tokens  {runs[0]['bytes'] / 1e6:8.1f} MB  {best * 1e3:8.1f} ms  "
                  f"{rows[-1]['gb_per_s']:5.2f} GB/s  (sender done {sent * 1e3:.1f} ms, receiver busy "
                  f"{busy * 1e3:.1f} ms, writer busy {written * 1e3:.1f} ms; export alone {export * 1e3:.1f} ms)",
                  flush=True)
    finally:
        sender.terminate()
        sender.wait()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "kv_grpc_throughput", "model": args.model, "device": args.device,
            "versions": {"torch": torch.__version__, "grpcio": grpc.__version__,
                         "python": platform.python_version()},
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "rows": rows},
            indent=1) + "\n")


if __name__ == "__main__":
    main()

"""`tandem bench serve`: load a running gateway through its public gRPC API and report latency.

Arrivals are Poisson at each given rate (or a burst, rate `inf`); prompts are random token ids with
lengths from a fixed distribution; every request ignores EOS so it generates exactly its output length.
Reported per rate: TTFT, TPOT (time per output token after the first), ITL (gaps between streamed
messages) and end-to-end latency percentiles, throughput, and goodput (requests per second that met
both the TTFT and the TPOT target). JSON out, a table last, and a PNG of latency against load.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pickle
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.v1 import generation_pb2, generation_pb2_grpc

# Token ids drawn for prompts: above SmolLM2's/Llama's special tokens, below every vocabulary we serve.
_MIN_TOKEN, _MAX_TOKEN = 1000, 49152


@dataclass(frozen=True)
class LengthDist:
    """`fixed:N`, `uniform:LO:HI`, or `sharegpt:IN|OUT` (a lognormal mix like ShareGPT's lengths)."""

    kind: str
    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        if parts[0] == "fixed" and len(parts) == 2:
            return cls("fixed", int(parts[1]), int(parts[1]))
        if parts[0] == "uniform" and len(parts) == 3 and int(parts[1]) <= int(parts[2]):
            return cls("uniform", int(parts[1]), int(parts[2]))
        if parts[0] == "sharegpt" and len(parts) == 3:
            return cls("sharegpt", int(parts[1]), int(parts[2]))
        raise ValueError(f"length distribution: expected fixed:N, uniform:LO:HI or sharegpt:MEDIAN:MAX, got {text!r}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        # Long-tailed around the median, clipped to [4, max].
        return max(4, min(self.high, int(rng.lognormvariate(math.log(self.low), 0.8))))


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int
    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None
    arrivals: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.first_token is None or self.num_tokens < 2:
            return None
        return (self.done - self.first_token) / (self.num_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]

    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


# The workload seed of the i-th rate of a run is seed + i * RATE_SEED_STRIDE.
RATE_SEED_STRIDE = 7919


def workload(num_requests: int, prompt_dist: LengthDist, output_dist: LengthDist,
             seed: int) -> Iterator[tuple[list[int], int]]:
    """(prompt token ids, output length) of each request, the same for a given seed (so other benchmarks
    can run the very workload the stack got)."""
    rng = random.Random(seed)
    for _ in range(num_requests):
        prompt_len, output_len = prompt_dist.sample(rng), output_dist.sample(rng)
        yield [rng.randrange(_MIN_TOKEN, _MAX_TOKEN) for _ in range(prompt_len)], output_len


async def _one(stub: generation_pb2_grpc.GenerationStub, record: RequestRecord, prompt: list[int],
               timeout: float) -> None:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=generation_pb2.SamplingParams(max_tokens=record.output_len, temperature=0.0, ignore_eos=True))
    record.sent = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=timeout):
            now = time.perf_counter()
            if response.token_ids:
                if record.first_token is None:
                    record.first_token = now
                record.arrivals.append(now)
                record.num_tokens += len(response.token_ids)
        record.done = time.perf_counter()
    except grpc.aio.AioRpcError as error:
        record.error = f"{error.code().name}: {error.details()}"


def schedule(rate: float, num_requests: int, prompt_dist: LengthDist, output_dist: LengthDist,
             seed: int) -> list[tuple[float, list[int], int]]:
    """(send offset in seconds, prompt, output length) of each request: Poisson arrivals at `rate`, all at 0 for
    a burst (`inf`)."""
    rng, offset, items = random.Random(seed), 0.0, []
    for prompt, output_len in workload(num_requests, prompt_dist, output_dist, seed):
        items.append((offset, prompt, output_len))
        if math.isfinite(rate):
            offset += rng.expovariate(rate)
    return items


def default_client_processes() -> int:
    """Load-generator processes for a burst: one per 4 CPUs, between 1 and 4. One Python process receives a few
    tens of thousands of streamed messages a second at most (grpc.aio's ~35 µs per message), below what a fast
    model's stack sends."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


async def _send_all(address: str, items: list[tuple[float, list[int], int]], start: float | None, timeout: float,
                    num_channels: int, ready: Callable[[], float] | None = None) -> tuple[list[RequestRecord], float]:
    """Send each request at `start` + its offset over `num_channels` connections; (records, end time). With `ready`,
    connect first and take the start time from it."""
    # A connection each: gRPC shares one connection among channels with the same arguments unless each has its
    # own subchannel pool, and `tandem gateway --workers N` spreads connections, not streams, over its processes.
    # With one shared connection per load-generator process, one gateway process took all of a process's streams.
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                            ("grpc.use_local_subchannel_pool", 1)])
                for _ in range(num_channels)]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    if ready is not None:
        await asyncio.gather(*(c.channel_ready() for c in channels))
        start = ready()
    assert start is not None
    records, tasks = [], []
    for i, (offset, prompt, output_len) in enumerate(items):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RequestRecord(len(prompt), output_len)
        records.append(record)
        tasks.append(asyncio.create_task(_one(stubs[i % num_channels], record, prompt, timeout)))
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    for channel in channels:
        await channel.close()
    return records, end


def client_process_main() -> None:
    """A load-generator process (`_run_processes`): its share of the requests from stdin, "ready" once connected,
    the common start time from stdin, its records to stdout."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    address, items, timeout, num_channels = pickle.loads(stdin.read(int.from_bytes(stdin.read(8), "little")))

    def ready() -> float:
        stdout.write(b"ready\n")
        stdout.flush()
        return float(stdin.readline())

    cpu = time.process_time()
    records, end = asyncio.run(_send_all(address, items, None, timeout, num_channels, ready))
    stdout.write(pickle.dumps(([asdict(r) for r in records], end, time.process_time() - cpu)))
    stdout.flush()


async def _run_processes(address: str, items: list[tuple[float, list[int], int]], timeout: float, num_channels: int,
                         processes: int) -> tuple[list[RequestRecord], float, float, float]:
    """The requests dealt round-robin to `processes` load-generator processes that start together (perf_counter is
    the system's monotonic clock, so their times compare); (records in order, start, end, their CPU seconds)."""
    children = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from tandem.benchmarks.serve import client_process_main; client_process_main()",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for _ in range(processes)]
    try:
        for p, child in enumerate(children):
            assert child.stdin is not None
            payload = pickle.dumps((address, items[p::processes], timeout, num_channels))
            child.stdin.write(len(payload).to_bytes(8, "little") + payload)
            await child.stdin.drain()
        for child in children:
            assert child.stdout is not None
            if await child.stdout.readline() != b"ready\n":
                raise RuntimeError("a load-generator process exited before it connected (its error is above)")
        start = time.perf_counter() + 0.01
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"{start!r}\n".encode())
            await child.stdin.drain()
        parts = [pickle.loads((await child.communicate())[0]) for child in children]
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    records = [RequestRecord(**parts[i % processes][0][i // processes]) for i in range(len(items))]
    return records, start, max(part[1] for part in parts), sum(part[2] for part in parts)


async def run_rate(address: str, rate: float, num_requests: int, prompt_dist: LengthDist, output_dist: LengthDist,
                   seed: int, timeout: float, num_channels: int = 4, processes: int = 1) -> dict[str, Any]:
    """One rate's requests; with `processes` > 1 the requests are dealt round-robin to that many load-generator
    processes that start together (perf_counter is the system's monotonic clock: their times compare). The
    result's `client_cpu_s` is the load generator's CPU time (with one process: all of this process's)."""
    items = schedule(rate, num_requests, prompt_dist, output_dist, seed)
    cpu = time.process_time()
    if processes <= 1:
        start = time.perf_counter()
        records, end = await _send_all(address, items, start, timeout, num_channels)
        client_cpu = time.process_time() - cpu
    else:
        records, start, end, client_cpu = await _run_processes(address, items, timeout, num_channels, processes)
    result = summarize(records, rate, end - start)
    result["client_processes"] = max(1, processes)
    result["client_cpu_s"] = client_cpu
    return result


def summarize(records: list[RequestRecord], rate: float, duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.done is not None]
    itl = [b - a for r in ok for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    output_tokens = sum(r.num_tokens for r in ok)
    return {
        "rate": rate if math.isfinite(rate) else "inf",
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in records if r.error}),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_per_s": output_tokens / duration,
        # Streamed messages that carried tokens, per token: below 1 where the server merged tokens.
        "messages_per_output_token": sum(len(r.arrivals) for r in ok) / output_tokens if output_tokens else None,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "records": [asdict(r) | {"arrivals": []} for r in records],
    }


def add_goodput(result: dict[str, Any], ttft_slo: float, tpot_slo: float) -> None:
    good = 0
    for r in result["records"]:
        if r["error"] is not None or r["done"] is None or r["first_token"] is None:
            continue
        ttft = r["first_token"] - r["sent"]
        tpot = (r["done"] - r["first_token"]) / (r["num_tokens"] - 1) if r["num_tokens"] > 1 else 0.0
        good += ttft <= ttft_slo and tpot <= tpot_slo
    result["goodput_rps"] = good / result["duration_s"]
    result["slo_attainment"] = good / max(1, result["num_requests"])


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in results if r["rate"] != "inf"]
    if not finite:
        return
    rates = [r["rate"] for r in finite]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("p50", "p50"), ("p99", "p99")):
        ax1.plot(rates, [(r["ttft_s"][key] or 0) * 1e3 for r in finite], marker="o", label=f"TTFT {label}")
        ax2.plot(rates, [(r["tpot_s"][key] or 0) * 1e3 for r in finite], marker="o", label=f"TPOT {label}")
    ax1.set(xlabel="offered load (req/s)", ylabel="ms", title="time to first token")
    ax2.set(xlabel="offered load (req/s)", ylabel="ms", title="time per output token")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(address: str, rates: list[float], num_requests: int, prompt_len: str, output_len: str,
        ttft_slo: float, tpot_slo: float, seed: int, timeout: float, out: Path | None, plot_path: Path | None,
        label: str = "", client_processes: int = 1) -> list[dict[str, Any]]:
    from tqdm import tqdm

    prompt_dist, output_dist = LengthDist.parse(prompt_len), LengthDist.parse(output_len)
    results = []
    for index, rate in enumerate(tqdm(rates, desc="rates")):
        # Each rate its own prompts: with one seed for all, every rate after the first found its prompts in the
        # stack's prefix cache and measured decode alone.
        rate_seed = seed + RATE_SEED_STRIDE * index
        result = asyncio.run(run_rate(address, rate, num_requests, prompt_dist, output_dist, rate_seed, timeout,
                                      processes=client_processes))
        result["seed"] = rate_seed
        add_goodput(result, ttft_slo, tpot_slo)
        results.append(result)
    report = {"benchmark": "serve", "label": label, "address": address, "prompt_len": prompt_len,
              "output_len": output_len, "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "results": results}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if plot_path is not None:
        plot(results, plot_path, label or address)
    print_table(results)
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    print(f"{'rate':>6} {'ok':>5} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} "
          f"{'ITL p99':>8} {'goodput':>8}")
    for r in results:
        print(f"{str(r['rate']):>6} {r['num_ok']:>5} {r['output_tok_per_s']:>8.1f} {ms(r['ttft_s']['p50']):>9} "
              f"{ms(r['ttft_s']['p99']):>8} {ms(r['tpot_s']['p50']):>9} {ms(r['tpot_s']['p99']):>8} "
              f"{ms(r['itl_s']['p99']):>8} {r['goodput_rps']:>8.2f}")

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
import random
import statistics
import time
from collections.abc import Iterator
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


async def run_rate(address: str, rate: float, num_requests: int, prompt_dist: LengthDist, output_dist: LengthDist,
                   seed: int, timeout: float, num_channels: int = 4) -> dict[str, Any]:
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
                for _ in range(num_channels)]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    records, tasks = [], []
    start = time.perf_counter()
    for i, (prompt, output_len) in enumerate(workload(num_requests, prompt_dist, output_dist, seed)):
        record = RequestRecord(len(prompt), output_len)
        records.append(record)
        tasks.append(asyncio.create_task(_one(stubs[i % num_channels], record, prompt, timeout)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    for channel in channels:
        await channel.close()
    return summarize(records, rate, duration)


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
        label: str = "") -> list[dict[str, Any]]:
    from tqdm import tqdm

    prompt_dist, output_dist = LengthDist.parse(prompt_len), LengthDist.parse(output_len)
    results = []
    for index, rate in enumerate(tqdm(rates, desc="rates")):
        # Each rate its own prompts: with one seed for all, every rate after the first found its prompts in the
        # stack's prefix cache and measured decode alone.
        rate_seed = seed + RATE_SEED_STRIDE * index
        result = asyncio.run(run_rate(address, rate, num_requests, prompt_dist, output_dist, rate_seed, timeout))
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

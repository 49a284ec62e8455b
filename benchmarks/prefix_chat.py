"""Prefix caching through the whole stack: multi-turn chat and a shared system prompt, the cache on and off.

    python -m tandem.benchmarks.prefix_chat --out benchmarks/results/cpu-2026-12-01/prefix-chat.json

Starts `tandem up --prefill 1 --decode 2` (SmolLM2-135M on the CPU by default) twice, with the prefix cache and
with `--no-prefix-caching`, and runs three workloads on each, one after the other, through the gateway's gRPC API:
- `chat`: `--conversations` chats of `--turns` turns sharing one ~1,000-token system prompt; each turn re-sends the
  whole history (the replies included); the chats run concurrently, each chat's turns in order;
- `shared`: `--shared-requests` one-turn chats, another ~1,000-token system prompt and a question of their own
  each, `--concurrency` in flight;
- `random`: `--random-requests` prompts as long made of random words, nothing shared (the cache must cost nothing).

Per workload and mode: TTFT p50/p99 (at the client: request sent → first token), output tokens per second, the
prefix cache hit rate of the decode and of the prefill workers (deltas of `tandem_prefix_cache_hits_total /
tandem_prefix_cache_queries_total` on their /metrics) next to the ideal one (the share of prompt tokens, in full
blocks and always leaving the last token, that an earlier request had sent or received), and the KV page bytes the
decode workers received per request (`tandem_kv_transfer_bytes_total`). Greedy, so both modes get the same replies.
JSON out, a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.benchmarks.serve import percentiles
from tandem.common.prefix_cache import block_hashes
from tandem.launcher import free_port
from tandem.v1 import generation_pb2, generation_pb2_grpc

BLOCK = 16  # the workers' block size (the default): the ideal hit rate counts full blocks
# ~1,000 tokens with SmolLM2's tokenizer once a workload's first line is put in front.
SYSTEM_PROMPT = """\
You are Orbit, the support assistant of Larkspur Cloud, a company that rents out virtual machines, managed
databases, object storage and a small content delivery network to developers and small businesses. You answer
customers in the chat window of the Larkspur console. Follow every rule below in every reply.

Tone and format. Be friendly, direct and brief: two to five sentences unless the customer asks for detail or a
step-by-step guide. Use plain words; explain a technical term the first time you use it. Never use marketing
language, never promise features that do not exist, and never guess at prices: quote only the price list below.
When you give commands, put each on its own line. When a task has more than three steps, number them.

What you can do. You can explain how Larkspur products work, walk customers through the console and the `lark`
command-line tool, help them read error messages, estimate monthly costs from the price list, and open a ticket
with the human support team. You cannot see customers' resources, logs or bills, reset passwords, issue refunds,
change quotas or make exceptions to policy. If a customer needs any of those, say so plainly and offer to open a
ticket; tell them the ticket number format (LC- followed by six digits) and that the team answers within one
business day, or within two hours for customers on the Priority plan.

Price list (monthly, in US dollars, excluding tax). Virtual machines: the Nano size (1 vCPU, 1 GB memory, 25 GB
disk) costs 5 dollars; Micro (1 vCPU, 2 GB, 50 GB) costs 10; Small (2 vCPU, 4 GB, 80 GB) costs 20; Medium
(4 vCPU, 8 GB, 160 GB) costs 40; Large (8 vCPU, 16 GB, 320 GB) costs 80. Machines are billed by the hour up to the
monthly price; a stopped machine still pays for its disk at 10 cents per GB. Managed PostgreSQL starts at 15 dollars
for 1 vCPU, 2 GB and 25 GB of storage, with daily backups kept for seven days; a standby replica doubles the price.
Object storage costs 2 cents per GB stored and 1 cent per GB downloaded; uploads are free. The content delivery
network costs 1 cent per GB served in North America and Europe and 3 cents elsewhere. Every account gets 1 TB of
outbound traffic per month for free; past it, traffic costs 1 cent per GB. The Priority support plan costs 49
dollars per month or 10 percent of the monthly bill, whichever is higher.

Regions. Larkspur runs three regions: Ashburn in the United States (code ash1), Frankfurt in Germany (fra1) and
Singapore (sin1). Resources live in one region; moving a machine between regions means taking a snapshot, copying
it (1 cent per GB) and creating a new machine from it. Private networks never span regions.

Security. Never ask for a password, an API token or a private key, and tell customers to revoke any secret they
paste into the chat. Two-factor authentication can be turned on under Account, Security. API tokens are created
under Account, Tokens; each token has a scope (read, write or admin) and an optional expiry date. Firewalls are
off by default on new machines: recommend allowing only the ports a customer needs, usually 22 for SSH and 80 and
443 for a website. Larkspur staff never contact customers by phone to ask for credentials.

Troubleshooting. When a machine does not answer, ask whether it shows as running in the console, whether its
firewall allows the port, and whether the service listens on the public interface. For a disk that is full, show
`df -h` and `du -sh /var/log/*`. For a database that refuses connections, check the trusted sources list under the
database's Settings tab. Quote error messages back exactly and explain what each part means. If a problem looks
like an outage, point customers to status.larkspur.example and do not speculate about causes.

Policy. Refunds are possible only for outages longer than the service level agreement allows (99.9 percent monthly
uptime for machines and databases), as service credits, requested within thirty days through a ticket. Accounts
that send spam, mine cryptocurrency or attack other networks are suspended without notice. Customers may cancel
at any time; resources are deleted seven days after cancellation, and backups thirty days after.

If you do not know an answer, say that you do not know and offer a ticket. Stay on the subject of Larkspur; for
anything else, politely say that you can only help with Larkspur products.
"""
TOPICS = ["the Small machine", "managed PostgreSQL", "object storage", "moving to Frankfurt", "API tokens",
          "a full disk", "the CDN", "refunds", "firewalls", "Priority support", "snapshots", "a database timeout",
          "cancelling", "two-factor authentication", "outbound traffic", "the Singapore region"]
WORDS = ("the of and to in is was for on that with as by at from his her their which this have are were one an "
         "but not had they all been has there who would what when can more about out up said some into time so "
         "them other then these two may first new only any its over such most like also after our made many "
         "system network storage database machine region cloud price month traffic support account token").split()


@dataclass
class Turn:
    """One request: what was sent, what came back, when."""

    workload: str
    messages: list[dict[str, str]]
    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    reply: str = ""
    cached_tokens: int = 0
    error: str | None = None


class Client:
    def __init__(self, address: str, max_tokens: int) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.max_tokens = max_tokens

    async def send(self, turn: Turn) -> None:
        messages = generation_pb2.Messages(messages=[generation_pb2.ChatMessage(**m) for m in turn.messages])
        request = generation_pb2.GenerateRequest(
            messages=messages, sampling=generation_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0.0))
        turn.prompt_ids = list((await self.stub.Tokenize(generation_pb2.TokenizeRequest(messages=messages))).token_ids)
        turn.sent = time.perf_counter()
        try:
            async for response in self.stub.Generate(request, timeout=1800):
                if response.token_ids and turn.first_token is None:
                    turn.first_token = time.perf_counter()
                turn.output_ids += response.token_ids
                turn.reply += response.text
                if response.finish_reason:
                    turn.cached_tokens = response.usage.cached_tokens
            turn.done = time.perf_counter()
        except grpc.aio.AioRpcError as error:
            turn.error = f"{error.code().name}: {error.details()}"


def system(name: str) -> str:
    return f"Workload {name}. {SYSTEM_PROMPT}"


async def chat(client: Client, num_conversations: int, num_turns: int) -> list[Turn]:
    turns: list[Turn] = []

    async def conversation(c: int) -> None:
        history = [{"role": "system", "content": system("chat")}]
        for t in range(num_turns):
            topic = TOPICS[(c + 5 * t) % len(TOPICS)]
            history.append({"role": "user", "content": f"Customer {c}, question {t + 1}: tell me about {topic}."})
            turn = Turn("chat", list(history))
            turns.append(turn)
            await client.send(turn)
            history.append({"role": "assistant", "content": turn.reply})

    await asyncio.gather(*(conversation(c) for c in range(num_conversations)))
    return turns


async def in_flight(client: Client, turns: list[Turn], concurrency: int) -> list[Turn]:
    queue = list(reversed(turns))

    async def worker() -> None:
        while queue:
            await client.send(queue.pop())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return turns


def shared(num_requests: int) -> list[Turn]:
    return [Turn("shared", [{"role": "system", "content": system("shared")},
                            {"role": "user", "content": f"Request {i}: how much does {TOPICS[i % len(TOPICS)]} "
                                                        f"cost me per month?"}]) for i in range(num_requests)]


def unshared(num_requests: int, num_words: int) -> list[Turn]:
    rng = random.Random(0)
    return [Turn("random", [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(num_words))}])
            for _ in range(num_requests)]


def ideal_cached_tokens(turns: Sequence[Turn], count_in_flight: bool = True) -> list[int]:
    """Per request: its leading prompt tokens, in full blocks and short of its last token, that an earlier request
    had sent (only if `count_in_flight`), or had finished with (its prompt and reply) by then. Without the requests
    in flight it is what a cache can hold at best: a prompt still being computed has no blocks to share yet."""
    seen: set[bytes] = set()
    events = sorted([(t.sent, 1, i) for i, t in enumerate(turns)]
                    + [(t.done or 0.0, 0, i) for i, t in enumerate(turns)])
    ideal = [0] * len(turns)
    for _, is_send, i in events:
        turn = turns[i]
        if is_send:
            hashes = block_hashes(turn.prompt_ids, BLOCK)[:(len(turn.prompt_ids) - 1) // BLOCK]
            ideal[i] = BLOCK * next((n for n, h in enumerate(hashes) if h not in seen), len(hashes))
            if count_in_flight:
                seen.update(block_hashes(turn.prompt_ids, BLOCK))
        else:
            seen.update(block_hashes(turn.prompt_ids + turn.output_ids, BLOCK))
    return ideal


def scrape(urls: Sequence[str]) -> dict[str, float]:
    """The counters this benchmark reads, summed over `urls` (workers' /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"tandem_prefix_cache_queries_total", "tandem_prefix_cache_hits_total", "tandem_kv_transfer_bytes_total",
              "tandem_decode_local_prefill_tokens_total", "tandem_prefill_prompt_tokens_total"}
    totals = dict.fromkeys(wanted, 0.0)
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    totals[sample.name] += sample.value
    return totals


def summarize(turns: list[Turn], seconds: float, before: dict[str, dict[str, float]],
              after: dict[str, dict[str, float]]) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None and t.first_token is not None and t.done is not None]
    delta = {role: {k: after[role][k] - before[role][k] for k in after[role]} for role in after}

    def hit_rate(role: str) -> float | None:
        queries = delta[role]["tandem_prefix_cache_queries_total"]
        return delta[role]["tandem_prefix_cache_hits_total"] / queries if queries else None

    prompt_tokens = sum(len(t.prompt_ids) for t in ok)
    ideal = sum(ideal_cached_tokens(ok))
    reachable = sum(ideal_cached_tokens(ok, count_in_flight=False))
    return {
        "num_requests": len(turns), "num_ok": len(ok), "errors": sorted({t.error for t in turns if t.error}),
        "duration_s": seconds, "prompt_tokens": prompt_tokens, "output_tokens": sum(len(t.output_ids) for t in ok),
        "output_tok_per_s": sum(len(t.output_ids) for t in ok) / seconds,
        "requests_per_s": len(ok) / seconds,
        "ttft_s": percentiles([t.first_token - t.sent for t in ok if t.first_token is not None]),
        "hit_rate_decode": hit_rate("decode"), "hit_rate_prefill": hit_rate("prefill"),
        "hit_rate_ideal": ideal / prompt_tokens if prompt_tokens else None,
        "hit_rate_ideal_finished": reachable / prompt_tokens if prompt_tokens else None,
        "usage_cached_tokens": sum(t.cached_tokens for t in ok),
        "kv_bytes_per_request": delta["decode"]["tandem_kv_transfer_bytes_total"] / max(1, len(ok)),
        "prefill_worker_prompt_tokens": delta["prefill"]["tandem_prefill_prompt_tokens_total"],
        "decode_local_prefill_tokens": delta["decode"]["tandem_decode_local_prefill_tokens_total"],
    }


async def run_workloads(address: str, urls: dict[str, list[str]], args: argparse.Namespace) -> dict[str, Any]:
    client = Client(address, args.max_tokens)
    results: dict[str, Any] = {}
    concurrency = args.concurrency
    plans = [("chat", args.conversations * args.turns, lambda: chat(client, args.conversations, args.turns)),
             ("shared", args.shared_requests, lambda: in_flight(client, shared(args.shared_requests), concurrency)),
             ("random", args.random_requests,
              lambda: in_flight(client, unshared(args.random_requests, args.random_words), concurrency))]
    for name, count, plan in plans:
        if count == 0:  # a workload left out (e.g. only the random prompts)
            continue
        before = {role: scrape(role_urls) for role, role_urls in urls.items()}
        start = time.perf_counter()
        turns = await plan()
        seconds = time.perf_counter() - start
        after = {role: scrape(role_urls) for role, role_urls in urls.items()}
        results[name] = summarize(turns, seconds, before, after)
        print(f"  {name}: {results[name]['num_ok']}/{len(turns)} in {seconds:.1f} s", flush=True)
    await client.channel.close()
    return results


def run_stack(caching: bool, args: argparse.Namespace) -> dict[str, Any]:
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    status = Path(tempfile.mkdtemp(prefix="tandem-prefix-chat-")) / "status.json"
    command = [sys.executable, "-m", "tandem.cli", "up", "--model", args.model, "--device", args.device,
               "--prefill", "1", "--decode", "2", "--port", str(port), "--http-port", str(http_port),
               "--status-file", str(status), "--threads", str(args.threads)]
    if not caching:
        command.append("--no-prefix-caching")
    log = status.with_name("stack.log")  # the services' own logs are under ~/.cache/tandem/logs/
    with log.open("wb") as log_file:
        stack = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        started = time.monotonic()
        while not status.exists():
            if stack.poll() is not None:
                raise SystemExit(f"the stack exited with {stack.returncode}; see {log}")
            if time.monotonic() - started > 600:
                raise SystemExit(f"the stack did not start in 600 s; see {log}")
            time.sleep(0.5)
        time.sleep(0.5)  # the status file is written whole, but give the gateway's first probes a moment
        services = json.loads(status.read_text())["services"]
        urls = {role: [s["http"] for s in services if s["role"] == role] for role in ("prefill", "decode")}
        print(f"prefix caching {'on' if caching else 'off'}: stack up in {time.monotonic() - started:.0f} s "
              f"(log: {log})", flush=True)
        return asyncio.run(run_workloads(f"127.0.0.1:{port}", urls, args))
    finally:
        stack.send_signal(signal.SIGTERM)
        try:
            stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stack.kill()


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {name: {
        "ttft_p50_off_over_on": ratio(off[name]["ttft_s"]["p50"], on[name]["ttft_s"]["p50"]),
        "ttft_p99_off_over_on": ratio(off[name]["ttft_s"]["p99"], on[name]["ttft_s"]["p99"]),
        "kv_bytes_off_over_on": ratio(off[name]["kv_bytes_per_request"], on[name]["kv_bytes_per_request"]),
        "throughput_on_over_off": ratio(on[name]["output_tok_per_s"], off[name]["output_tok_per_s"]),
        "decode_hit_rate_over_ideal": ratio(on[name]["hit_rate_decode"], on[name]["hit_rate_ideal"]),
        "decode_hit_rate_over_ideal_finished": ratio(on[name]["hit_rate_decode"], on[name]["hit_rate_ideal_finished"]),
        "prefill_hit_rate_over_ideal": ratio(on[name]["hit_rate_prefill"], on[name]["hit_rate_ideal"]),
    } for name in on}


def print_table(report: dict[str, Any]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    print(f"\n{'workload':<8} {'cache':<5} {'TTFT p50 ms':>11} {'p99 ms':>8} {'out tok/s':>9} {'hit dec':>7} "
          f"{'hit pre':>7} {'ideal':>6} {'ideal*':>6} {'KV KB/req':>9}")
    for name in report["runs"]["on"]:
        for mode in ("on", "off"):
            r = report["runs"][mode][name]
            print(f"{name:<8} {mode:<5} {ms(r['ttft_s']['p50']):>11} {ms(r['ttft_s']['p99']):>8} "
                  f"{r['output_tok_per_s']:>9.1f} {pct(r['hit_rate_decode']):>7} {pct(r['hit_rate_prefill']):>7} "
                  f"{pct(r['hit_rate_ideal']):>6} {pct(r['hit_rate_ideal_finished']):>6} "
                  f"{r['kv_bytes_per_request'] / 1024:>9.0f}")
    print("ideal: prompt tokens an earlier request sent or got; ideal*: only from requests finished by then")
    for name, c in report["comparison"].items():
        parts = [f"{key} {value:.2f}" for key, value in c.items() if value is not None]
        print(f"{name}: " + ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--shared-requests", type=int, default=16)
    parser.add_argument("--random-requests", type=int, default=8)
    parser.add_argument("--random-words", type=int, default=1050, help="words per random prompt (~1.05 tokens each)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (shared and random)")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply length at most")
    parser.add_argument("--modes", default="on,off", help="on, off or both")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = {mode: run_stack(mode == "on", args) for mode in args.modes.split(",")}
    report: dict[str, Any] = {
        "benchmark": "prefix_chat", "model": args.model, "device": args.device, "threads": args.threads,
        "stack": "tandem up --prefill 1 --decode 2 (static registry)", "machine": platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs}
    if "on" in runs and "off" in runs:
        report["comparison"] = compare(runs["on"], runs["off"])
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if "comparison" in report:
        print_table(report)


if __name__ == "__main__":
    main()

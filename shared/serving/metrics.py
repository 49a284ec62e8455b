"""Prometheus metrics, defined once; every service exports them on its HTTP port at `/metrics`.

Names and units follow Prometheus conventions (`_seconds`, `_total`); which service sets which is in
docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)

TIME_TO_FIRST_TOKEN = Histogram("tandem_time_to_first_token_seconds", "Time from arrival to the first token",
                                buckets=_LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram("tandem_time_per_output_token_seconds",
                                  "Mean time per output token after the first, per request",
                                  buckets=_TOKEN_BUCKETS)
E2E_LATENCY = Histogram("tandem_e2e_request_latency_seconds", "Time from arrival to the last token",
                        buckets=_LATENCY_BUCKETS)
REQUESTS = Counter("tandem_requests", "Requests ended, by status", ["status"])
QUEUE_DEPTH = Gauge("tandem_queue_depth", "Requests waiting to be scheduled")
KV_BLOCKS_TOTAL = Gauge("tandem_kv_blocks_total", "KV cache blocks in the pool")
KV_BLOCKS_FREE = Gauge("tandem_kv_blocks_free", "KV cache blocks free to allocate (cached blocks no request "
                       "holds count: they are evicted when needed)")
KV_BLOCKS_CACHED = Gauge("tandem_kv_blocks_cached", "KV cache blocks in the prefix cache (held or evictable)")
KV_TRANSFER_BYTES = Counter("tandem_kv_transfer_bytes", "KV page bytes shipped or received")
KV_TRANSFER_SECONDS = Histogram("tandem_kv_transfer_seconds", "Time to move one request's KV pages",
                                buckets=_LATENCY_BUCKETS)
KV_TRANSFER_FAILURES = Counter("tandem_kv_transfer_failures", "KV transfers that failed")
KV_INTEGRITY_FAILURES = Counter("tandem_kv_integrity_failures",
                                "KV page messages refused for a checksum or size mismatch (never written)")
LOCAL_PREFILL_TOKENS = Counter("tandem_decode_local_prefill_tokens",
                               "Prompt tokens a decode worker computed itself, by why (no_prefill_worker, "
                               "short_prompt, transfer_failed, transfer_refused, unknown_prefill_worker, "
                               "prefix_cached, shared_prefix_failed, shared_prefix_wait, preemption)", ["reason"])
SPEC_DRAFT_TOKENS = Counter("tandem_spec_decode_num_draft_tokens", "Speculative proposals verified")
SPEC_ACCEPTED_TOKENS = Counter("tandem_spec_decode_num_accepted_tokens", "Speculative proposals accepted")
SPEC_DRAFT_PROMPT_TOKENS = Counter("tandem_spec_decode_draft_prompt_tokens",
                                   "Prompt tokens a draft model computed on this worker (its K/V of the prompt are "
                                   "never shipped: computed here, also after a remote prefill)")
TRITON_COMPILES = Counter("tandem_triton_compiles", "Triton kernel compiles, by phase (serving: a request waited "
                          "for one that start-up did not reach)", ["phase"])
PREFILL_PROMPT_TOKENS = Counter("tandem_prefill_prompt_tokens", "Prompt tokens a prefill worker computed")
GATEWAY_STREAM_INTERVAL = Gauge("tandem_gateway_stream_interval",
                                "Tokens per client message the gateway's pacer asks for (1 unless saturated; "
                                "--max-stream-interval)")
WORKERS_REFUSED = Gauge("tandem_gateway_workers_refused",
                        "Workers the gateway refuses because they serve another model")
BATCH_SIZE = Histogram("tandem_batch_size", "Requests per engine step",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))


def observe_latency(time_to_first_token_s: float, e2e_s: float, num_output_tokens: int) -> None:
    """One finished request's latency histograms (TPOT only when there is a token after the first)."""
    TIME_TO_FIRST_TOKEN.observe(time_to_first_token_s)
    E2E_LATENCY.observe(e2e_s)
    if num_output_tokens > 1:
        TIME_PER_OUTPUT_TOKEN.observe((e2e_s - time_to_first_token_s) / (num_output_tokens - 1))


class _PrefixCacheCollector:
    """`tandem_prefix_cache_queries_total` and `tandem_prefix_cache_hits_total`, in prompt tokens as vLLM counts
    them (per admitted request: its tokens, and those found cached), read from the engine at scrape time."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def collect(self) -> Iterator[Metric]:
        queries, hits = self.read()
        yield CounterMetricFamily("tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=queries)
        yield CounterMetricFamily("tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache", value=hits)


_PREFIX_CACHE = _PrefixCacheCollector()
REGISTRY.register(_PREFIX_CACHE)


def track_pool(num_total: Callable[[], int], num_free: Callable[[], int], queue_depth: Callable[[], int],
               num_cached: Callable[[], int] = lambda: 0,
               prefix_cache: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
    """Read the engine's pool, queue and prefix cache at scrape time (no bookkeeping on the hot path)."""
    KV_BLOCKS_TOTAL.set_function(num_total)
    KV_BLOCKS_FREE.set_function(num_free)
    KV_BLOCKS_CACHED.set_function(num_cached)
    QUEUE_DEPTH.set_function(queue_depth)
    _PREFIX_CACHE.read = prefix_cache


def serve_metrics(port: int, host: str = "0.0.0.0") -> int:
    """Start the `/metrics` HTTP server in a thread; returns the bound port (0 picks one)."""
    server, _ = start_http_server(port, addr=host)
    return int(server.server_port)

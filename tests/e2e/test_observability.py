"""The stack as processes (`tandem up`), observed as an operator does: each service's `/metrics` parses as
Prometheus text and moves as requests run, and each process exports its spans over OTLP, configured by
the standard variables, so that one trace covers the three services."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.test_stack import RunningStack, start_stack
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_REQUESTS, MAX_TOKENS = 2, 8

# (service, span) pairs each request's trace must hold once every process has exported.
TRACED_SPANS = {("tandem-gateway", "generate"), ("tandem-gateway", "stream"), ("tandem-decode", "decode.generate"),
                ("tandem-decode", "kv.transfer"), ("tandem-prefill", "prefill")}

# Each metric of the issue, on the services that must export it.
EXPORTED = {
    "gateway": ["tandem_time_to_first_token_seconds", "tandem_time_per_output_token_seconds",
                "tandem_e2e_request_latency_seconds", "tandem_requests"],
    "decode": ["tandem_time_to_first_token_seconds", "tandem_time_per_output_token_seconds",
               "tandem_e2e_request_latency_seconds", "tandem_requests", "tandem_queue_depth",
               "tandem_kv_blocks_total", "tandem_kv_blocks_free", "tandem_kv_transfer_bytes",
               "tandem_kv_transfer_seconds", "tandem_kv_transfer_failures", "tandem_decode_local_prefill_tokens",
               "tandem_batch_size"],
    "prefill": ["tandem_kv_blocks_total", "tandem_kv_blocks_free", "tandem_queue_depth", "tandem_kv_transfer_bytes",
                "tandem_batch_size"],
}


def scrape(stack: RunningStack, role: str) -> dict[str, float]:
    """Every sample of the service's /metrics, by name and labels, e.g. 'tandem_requests_total{status=length}'."""
    url = str(next(s for s in stack.services if s["role"] == role)["http"]) + "/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples: dict[str, float] = {}
    families = {family.name: family for family in text_string_to_metric_families(text)}  # raises if malformed
    for name in EXPORTED[role]:
        assert name in families, f"{role} does not export {name}"
    for family in families.values():
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:  # buckets add nothing the count and sum do not show here
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def generate(address: str, request_id: str) -> None:
    request = generation_pb2.GenerateRequest(prompt="Tell me about the sea.", request_id=request_id,
                                             sampling=generation_pb2.SamplingParams(
                                                 max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as channel:
        async for _ in generation_pb2_grpc.GenerationStub(channel).Generate(request):
            pass


async def test_metrics_move_and_one_trace_spans_the_processes(tmp_path: Path, smollm2_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = await OtlpReceiver.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # ms: export soon after a span ends
    try:
        for stack in start_stack(tmp_path, model="dummy:tiny"):
            before = {role: scrape(stack, role) for role in EXPORTED}
            for i in range(NUM_REQUESTS):
                await generate(stack.address("gateway"), f"obs-{i}")
            after = {role: scrape(stack, role) for role in EXPORTED}

            def moved(role: str, name: str, before: dict[str, dict[str, float]] = before,
                      after: dict[str, dict[str, float]] = after) -> float:
                return after[role].get(name, 0.0) - before[role].get(name, 0.0)

            for role in ("gateway", "decode"):
                assert moved(role, "tandem_requests_total{status=length}") == NUM_REQUESTS
                for histogram in ("tandem_time_to_first_token_seconds", "tandem_time_per_output_token_seconds",
                                  "tandem_e2e_request_latency_seconds"):
                    assert moved(role, histogram + "_count") == NUM_REQUESTS, (role, histogram)
                    assert moved(role, histogram + "_sum") > 0, (role, histogram)
            assert moved("decode", "tandem_kv_transfer_bytes_total") > 0
            assert moved("decode", "tandem_kv_transfer_seconds_count") == NUM_REQUESTS
            assert moved("decode", "tandem_batch_size_count") >= MAX_TOKENS - 1  # decode steps
            assert moved("decode", "tandem_decode_local_prefill_tokens_total") == 0
            assert after["decode"]["tandem_kv_transfer_failures_total"] == 0
            # The bytes decode received are the bytes prefill sent.
            sent, received = (moved(role, "tandem_kv_transfer_bytes_total") for role in ("prefill", "decode"))
            assert sent == received
            assert moved("prefill", "tandem_batch_size_count") >= 1
            for role in ("prefill", "decode"):
                assert after[role]["tandem_kv_blocks_total"] > 0
                assert after[role]["tandem_kv_blocks_free"] == after[role]["tandem_kv_blocks_total"]

            def traced(spans: list[ReceivedSpan]) -> bool:
                # Every span asserted below, in every request's trace: each process exports on its own
                # schedule, so one service's first spans may arrive before its last ones.
                roots = {s.trace_id for s in spans if s.name == "generate"}
                return len(roots) == NUM_REQUESTS and all(
                    TRACED_SPANS <= {(s.service, s.name) for s in spans if s.trace_id == trace_id}
                    for trace_id in roots)

            spans = await receiver.wait_for(traced)
    finally:
        await receiver.stop()
    for root in (s for s in spans if s.name == "generate"):
        in_trace = {s.name: s for s in spans if s.trace_id == root.trace_id}
        assert in_trace["prefill"].parent_span_id == in_trace["kv.transfer"].span_id
        assert in_trace["decode.generate"].parent_span_id == in_trace["stream"].span_id
        assert in_trace["kv.transfer"].attributes["tandem.kv.bytes"] > 0

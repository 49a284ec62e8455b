"""Tracing configuration from the standard OTEL_* variables (no sockets: exporters connect lazily)."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from tandem.common.config import ConfigError
from tandem.serving.telemetry import exporter_from_env, extract_context, inject_metadata

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


@pytest.mark.parametrize("env", [
    {},  # no endpoint: off, rather than the SDK's localhost default
    {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"},
    {**ENDPOINT, "OTEL_SDK_DISABLED": "true"},
])
def test_tracing_is_off_without_an_exporter(env: dict[str, str]) -> None:
    assert exporter_from_env(env) is None


def test_otlp_over_grpc_is_the_default() -> None:
    exporter = exporter_from_env(ENDPOINT)
    assert isinstance(exporter, GrpcExporter)
    exporter.shutdown()


def test_http_protobuf_adds_the_traces_path_to_the_base_endpoint() -> None:
    exporter = exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
                                  "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://collector:4318/v1/traces"
    exact = exporter_from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom",
                               "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert isinstance(exact, HttpExporter) and exact._endpoint == "http://c:4318/custom"


def test_console_and_bad_values() -> None:
    assert isinstance(exporter_from_env({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        exporter_from_env({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="zipkin"):
        exporter_from_env({**ENDPOINT, "OTEL_TRACES_EXPORTER": "zipkin"})


def test_nothing_is_injected_when_nothing_is_traced() -> None:
    assert inject_metadata() is None
    assert not extract_context([("traceparent", "garbage"), ("bin-bin", b"\x00")])


def test_trace_context_round_trips_through_grpc_metadata() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    span = TracerProvider().get_tracer("test").start_span("caller")
    metadata = inject_metadata(trace.set_span_in_context(span))
    assert metadata is not None and metadata[0][0] == "traceparent"
    received = trace.get_current_span(extract_context(metadata)).get_span_context()
    assert (received.trace_id, received.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
    assert received.is_remote

"""OpenTelemetry tracing for the services: setup from the standard `OTEL_*` variables, W3C trace context
in gRPC metadata, and one helper that ends a span and records what went wrong on it.

Only the services (and `shared/service.py`) import this module; the engine core knows nothing of
tracing. A request's trace crosses processes as a `traceparent` metadata entry on the gateway → decode
and decode → prefill calls.

When tracing is off (no OTLP endpoint, or `OTEL_TRACES_EXPORTER=none`, or `OTEL_SDK_DISABLED=true`) no
tracer provider is installed: the API's no-op tracer hands out non-recording spans, nothing is exported,
and nothing is injected into the calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode

from tandem.common.config import ConfigError

# `service.name` of each role, as Jaeger lists them.
SERVICE_NAMES = {"gateway": "tandem-gateway", "prefill": "tandem-prefill", "decode": "tandem-decode"}

# The instrumentation scope of each service's spans.
TRACER_NAMES = {role: f"tandem.{role}" for role in SERVICE_NAMES}

_PROTOCOLS = ("grpc", "http/protobuf")


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter | None:
    """The span exporter the standard variables ask for, or None when tracing is off.

    Honoured: `OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER` (otlp, console, none),
    `OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT` and `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` (grpc, the default,
    or http/protobuf). Headers, timeout, compression and TLS variables are read by the exporter itself.
    Unlike the SDK's own default (localhost:4317), no endpoint means no tracing: a service must not
    spend a thread retrying a collector nobody asked for.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = {name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if name.strip()}
    if not names or "none" in names:
        return None
    unknown = names - {"otlp", "console"}
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(sorted(unknown))} not supported (otlp, console, none)")
    if "console" in names:  # for a quick look without a collector
        return ConsoleSpanExporter()
    traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    endpoint = traces_endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not endpoint:
        return None
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        # The general endpoint is a base URL to which each signal adds its path; the traces one is used as is.
        return HttpExporter(endpoint=traces_endpoint or endpoint.rstrip("/") + "/v1/traces")
    raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} not supported ({', '.join(_PROTOCOLS)})")


def make_tracer_provider(service_name: str, exporter: SpanExporter, instance_id: str | None = None) -> TracerProvider:
    """A provider whose spans carry `service.name` and go to `exporter` in batches, from a background
    thread (off the request path). `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and `OTEL_BSP_*`
    apply as the SDK defines them."""
    attributes = {SERVICE_NAME: service_name}
    if instance_id:
        attributes[SERVICE_INSTANCE_ID] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None, exporter: SpanExporter | None = None,
                  instance_id: str | None = None) -> TracerProvider | None:
    """Install the process-wide tracer provider of a service, configured by `env` (default: the process
    environment) unless `exporter` is given; None, and nothing installed, when tracing is off.

    The global provider can be set once per process; code that hosts several services in one process
    (the tests) builds a provider per service with `make_tracer_provider` and hands each service its
    tracer instead. Call `shutdown()` on the result at exit to flush the spans still queued.
    """
    exporter = exporter or exporter_from_env(os.environ if env is None else env)
    if exporter is None:
        return None
    provider = make_tracer_provider(service_name, exporter, instance_id)
    trace.set_tracer_provider(provider)
    return provider


def get_tracer(role: str) -> trace.Tracer:
    """The process-wide tracer of a service role (a proxy until `setup_tracing` installs a provider)."""
    return trace.get_tracer(TRACER_NAMES[role])


# -- W3C trace context in gRPC metadata ---------------------------------------------------------------------
def inject_metadata(context: Context | None = None) -> tuple[tuple[str, str], ...] | None:
    """Metadata carrying the trace context of `context` (default: the current one) to the next service;
    None when there is nothing to carry (tracing off)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items()) or None


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from a call's invocation metadata (empty if it sent none)."""
    # Binary ("-bin") entries carry no trace context; gRPC already lower-cases the keys.
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)


# -- spans ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def ending(span: Span) -> Iterator[Span]:
    """Ends `span` when the block exits. An exception leaving the block is recorded on the span (an
    `exception` event and ERROR status) and re-raised; a cancelled call is marked `tandem.cancelled`.

    Unlike `start_as_current_span`, this does not make the span current: services hand contexts on
    explicitly, because a context attached inside an async generator would leak into its consumer at
    every `yield` and could be detached from another context when the generator is closed.
    """
    try:
        yield span
    except (asyncio.CancelledError, GeneratorExit):
        # A client cancel, or a stop string ending the stream early: not an error of this service.
        span.set_attribute("tandem.cancelled", True)
        raise
    except Exception as error:  # recorded for the trace, then re-raised untouched
        record_error(span, error)
        raise
    finally:
        span.end()


def record_error(span: Span, error: BaseException) -> None:
    """Mark `span` failed by `error` when the service handles the error itself (e.g. a fallback)."""
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

"""A test OTLP receiver: a real gRPC `TraceService` (the opentelemetry-proto messages) on loopback that
keeps every span it is sent, flattened with its service's name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


def attributes_of(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace id, span id) of each link
    is_error: bool
    event_names: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, service: str, span: trace_pb2.Span) -> ReceivedSpan:
        return cls(service=service, name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                   parent_span_id=span.parent_span_id.hex(), attributes=attributes_of(span.attributes),
                   links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                   is_error=span.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                   event_names=[event.name for event in span.events])


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Start with `await OtlpReceiver.start()`; `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.server: grpc.aio.Server | None = None
        self.endpoint = ""

    @classmethod
    async def start(cls) -> OtlpReceiver:
        receiver = cls()
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        receiver.server, receiver.endpoint = server, f"http://127.0.0.1:{port}"
        return receiver

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = str(attributes_of(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                self.spans += [ReceivedSpan.of(service, span) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    async def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], flush: Callable[[], object] | None = None,
                       timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Spans received once `done(spans)` holds; `flush` (blocking, run in a thread so this loop keeps
        serving the exporter's calls) pushes the exporters' queues out."""
        deadline = time.monotonic() + timeout_s
        while not done(self.spans):
            assert time.monotonic() < deadline, f"spans not received in {timeout_s} s: " + \
                ", ".join(sorted(f"{s.service}/{s.name}" for s in self.spans))
            if flush is not None:
                await asyncio.to_thread(flush)
            await asyncio.sleep(0.05)
        return self.spans

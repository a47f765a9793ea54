"""The OpenTelemetry side of ``runtime/server/tracing.py``: spans over OTLP/HTTP (protobuf).

Imported only with ``--otlp-traces-endpoint`` (the ``otel`` extra). Spans are queued to the
SDK's BatchSpanProcessor, whose thread exports them: a request never waits on the collector.
An export that fails (collector down, refused, bad URL) is logged once; its spans, and those of
later failures, are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # tracing.py imports this module when tracing is on
    from runtime.server.tracing import RequestTrace

logger = logging.getLogger(__name__)

# Tests set this (e.g. the SDK's InMemorySpanExporter) before the server starts: spans go there
# instead of to the endpoint.
TEST_EXPORTER: SpanExporter | None = None
# The exporter's own loggers, which would log every failed batch and retry: WarnOnceExporter
# speaks for them.
_QUIETED_LOGGERS = ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk._shared_internal")
EXPORT_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0


def traces_url(endpoint: str) -> str:
    """``endpoint`` as the exporter posts to: a URL without a path gets OTLP's /v1/traces."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


class WarnOnceExporter(SpanExporter):
    """``inner``, with failed exports (a FAILURE or an exception) logged as one warning for the
    server's life; their spans are dropped."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.failures = 0
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        why = "the collector refused them or could not be reached"
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter must not take the processor's thread down
            result, why = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        if result is not SpanExportResult.SUCCESS:
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first:
                logger.warning(
                    "could not export %d trace spans to %s (%s); spans are dropped while "
                    "exports fail, and this is not logged again",
                    len(spans), self.endpoint, why,
                )  # fmt: skip
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class OtlpSpanSink:
    """Turns finished RequestTraces into spans of service ``arbor``, exported in batches."""

    def __init__(self, endpoint: str) -> None:
        url = traces_url(endpoint)
        exporter = TEST_EXPORTER or OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        for name in _QUIETED_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.exporter = WarnOnceExporter(exporter, url)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "arbor"}))
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("arbor")
        self.propagator = TraceContextTextMapPropagator()

    def emit(self, trace: RequestTrace, end_ns: int, status_code: int, error: str | None) -> None:
        try:
            self._record(trace, end_ns, status_code, error)
        except Exception:  # a span is never worth a request: drop it
            logger.exception("could not record the trace span of %s %s", trace.method, trace.path)

    def _record(
        self, trace: RequestTrace, end_ns: int, status_code: int, error: str | None
    ) -> None:
        carrier = {"traceparent": trace.traceparent or "", "tracestate": trace.tracestate or ""}
        parent = self.propagator.extract(carrier) if trace.traceparent else None
        span = self.tracer.start_span(
            trace.span_name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=trace.attributes(status_code),
            start_time=trace.start_ns,
        )
        if error is not None or status_code >= 500:
            span.set_attribute("error.type", error.split(":")[0] if error else str(status_code))
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(end_ns, trace.start_ns))

    def shutdown(self) -> None:
        """Export what is queued and stop, giving up after SHUTDOWN_TIMEOUT_S (the processor
        exports batch after batch, each up to EXPORT_TIMEOUT_S while the collector is down)."""
        closer = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        closer.start()
        closer.join(SHUTDOWN_TIMEOUT_S)

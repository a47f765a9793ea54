"""``python -m tests.server.otel_capture serve ...``: ``arbor serve`` whose trace spans go to the
SDK's InMemorySpanExporter (the test hook ``runtime.server.otel.TEST_EXPORTER``) instead of an
OTLP endpoint, each also written as one JSON line to the file named by ARBOR_TEST_SPANS_FILE,
where a test reads them."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from runtime import cli
from runtime.server import otel


def span_record(span: ReadableSpan) -> dict:
    """What the tests check of a span, JSON-able."""
    assert span.context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


class FileBackedExporter(InMemorySpanExporter):
    """Keeps spans in memory, as its base does, and appends each to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        with self.lock, open(self.path, "a") as out:
            for span in spans:
                out.write(json.dumps(span_record(span), default=list) + "\n")
        return result


if __name__ == "__main__":
    otel.TEST_EXPORTER = FileBackedExporter(os.environ["ARBOR_TEST_SPANS_FILE"])
    sys.exit(cli.main())

"""OpenTelemetry tracing of API requests (``--otlp-traces-endpoint``): one span per request.

Off by default; then no middleware runs and nothing of opentelemetry is imported. On:

1. ``TracingMiddleware`` notes each HTTP request's arrival, its W3C ``traceparent`` (and
   ``tracestate``), and makes its ``GenerationLog`` current (``runtime/generation_log.py``).
2. A handler that serves generations calls ``trace_request`` with the operation and what was
   asked (model, max tokens, temperature, top p, response id). Requests whose handler does not
   (``/health``, ``/metrics``, refusals before that point) get no span.
3. Every generation the request runs logs its usage and the scheduler's queue, prefill and
   decode times there.
4. Once the response has been sent (a stream's last byte included), the span is made with the
   request's own start and end times, as a child of the incoming ``traceparent`` if any, and
   handed to the exporter (``runtime/server/otel.py``), which sends batches in the background:
   an endpoint that is down costs one warning, never a request.

Attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) where they apply,
plus Arbor's (``arbor.*``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.generation_log import GenerationLog, reset_generation_log, set_generation_log
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Where the middleware leaves a request's RequestTrace in its HTTP scope.
TRACE_SCOPE_KEY = "arbor.trace"

AttributeValue = str | bool | int | float | Sequence[str]


@dataclass
class RequestTrace:
    """What one HTTP request's span will say: set by the middleware (arrival, trace context),
    the handler (``trace_request``) and the request's generations (``generations``)."""

    start_ns: int  # time.time_ns() at arrival
    method: str
    path: str
    traceparent: str | None = None
    tracestate: str | None = None
    operation: str | None = None  # gen_ai.operation.name; None: no span
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    response_id: str | None = None
    program_id: str | None = None
    generations: GenerationLog = field(default_factory=GenerationLog)

    @property
    def span_name(self) -> str:
        """As the GenAI conventions name spans: the operation, then the model."""
        return f"{self.operation} {self.model}" if self.model else str(self.operation)

    def attributes(self, status_code: int) -> dict[str, AttributeValue]:
        """The span's attributes once the response (``status_code``) has been sent."""
        log = self.generations
        found: dict[str, AttributeValue | None] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": "arbor",
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": self.max_tokens,
            "gen_ai.request.temperature": self.temperature,
            "gen_ai.request.top_p": self.top_p,
            "http.request.method": self.method,
            "url.path": self.path,
            "http.response.status_code": status_code,
            "arbor.program.id": self.program_id,
        }
        if log.generations:
            found |= {
                "gen_ai.response.id": self.response_id or log.ids[0],
                "gen_ai.response.model": self.model,
                "gen_ai.response.finish_reasons": list(log.finish_reasons),
                "gen_ai.usage.input_tokens": log.prompt_tokens,
                "gen_ai.usage.output_tokens": log.completion_tokens,
                "arbor.usage.cached_tokens": log.cached_tokens,
                "arbor.generations": log.generations,
                "arbor.queue_time_s": log.queue_s,
                "arbor.prefill_time_s": log.prefill_s,
                "arbor.decode_time_s": log.decode_s,
            }
        elif self.response_id is not None:
            found["gen_ai.response.id"] = self.response_id
        return {key: value for key, value in found.items() if value is not None}


class SpanSink(Protocol):
    """Where finished requests' spans go (``runtime/server/otel.py``'s OtlpSpanSink)."""

    def emit(self, trace: RequestTrace, end_ns: int, status_code: int, error: str | None) -> None:
        """Record ``trace`` as a span ending at ``end_ns``; must not block or raise."""

    def shutdown(self) -> None:
        """Send what is queued (bounded in time) and stop."""


def open_span_sink(endpoint: str | None) -> SpanSink | None:
    """The OTLP exporter of ``--otlp-traces-endpoint`` (None, and nothing imported, when it is
    off). RuntimeError naming the extra when opentelemetry is not installed."""
    if endpoint is None:
        return None
    try:
        from runtime.server.otel import OtlpSpanSink
    except ImportError as exc:
        raise RuntimeError(
            f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'arbor[otel]' ({exc})"
        ) from None
    return OtlpSpanSink(endpoint)


def trace_request(
    request: Request,
    operation: str,
    *,
    model: str,
    sampling: SamplingParams | None = None,
    response_id: str | None = None,
) -> RequestTrace | None:
    """Give this request a span (when tracing is on; else None and nothing happens).

    ``operation``: the GenAI operation name ("chat", "text_completion"); ``model``: the
    served model's name; ``sampling``: the request's (first) sampling params, for max tokens,
    temperature and top p; ``response_id``: the id the API answers with (default: the first
    generation's request id). Call it once the body has been read and checked; the usage and
    timings of the generations the request then runs are added by themselves. The returned
    trace takes further facts (``program_id``, ``response_id``) until the response ends."""
    trace = request.scope.get(TRACE_SCOPE_KEY)
    if not isinstance(trace, RequestTrace):
        return None
    trace.operation, trace.model = operation, model
    if sampling is not None:
        trace.max_tokens = sampling.max_new_tokens
        trace.temperature, trace.top_p = sampling.temperature, sampling.top_p
    if response_id is not None:
        trace.response_id = response_id
    return trace


class TracingMiddleware:
    """Plain ASGI (streams and disconnects pass through untouched): a RequestTrace per HTTP
    request, emitted to ``sink`` after the response ends if its handler called
    ``trace_request``."""

    def __init__(self, app: ASGIApp, sink: SpanSink) -> None:
        self.app = app
        self.sink = sink

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope.get("headers", ())
        }
        trace = RequestTrace(
            time.time_ns(),
            scope.get("method", ""),
            scope.get("path", ""),
            headers.get("traceparent"),
            headers.get("tracestate"),
        )
        scope[TRACE_SCOPE_KEY] = trace
        status_code = 500  # unless a response starts
        error: str | None = None

        async def watched_send(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = int(message["status"])
            await send(message)

        token = set_generation_log(trace.generations)
        try:
            await self.app(scope, receive, watched_send)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            reset_generation_log(token)
            if trace.operation is not None:
                self.sink.emit(trace, time.time_ns(), status_code, error)

"""OpenTelemetry request spans (``--otlp-traces-endpoint``): a server whose spans go to the
SDK's InMemorySpanExporter (``tests/server/otel_capture.py``), a server whose collector cannot be
reached, and tracing off importing nothing."""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from runtime.server import ServerProcess
from runtime.server.child_process import free_port
from runtime.server.otel import WarnOnceExporter, traces_url
from runtime.server_args import ServerArgs
from tests.server.server_process import POOL, sse_payloads

PROMPT = "Tracing tells where a request's time went:"
SPAN_WAIT_S = 20.0


@pytest.fixture(scope="module")
def traced(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    spans_file = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ARBOR_TEST_SPANS_FILE", str(spans_file))
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans reach the file at once
        process = ServerProcess(
            tiny_model_path, *POOL, "--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces",
            cli_module="tests.server.otel_capture",
        )  # fmt: skip
    try:
        process.wait_ready()
        process.spans_file = spans_file  # type: ignore[attr-defined]
        yield process
    finally:
        process.stop()


def spans_where(server: Any, match: dict[str, Any], count: int = 1) -> list[dict[str, Any]]:
    """The exported spans whose fields (or attributes, for dotted keys) equal ``match``, once
    ``count`` of them have arrived."""
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        found = []
        if server.spans_file.exists():
            for line in server.spans_file.read_text().splitlines():
                span = json.loads(line)
                fields = {**span, **span["attributes"]}
                if all(fields.get(key) == value for key, value in match.items()):
                    found.append(span)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def traceparent() -> tuple[str, str, str]:
    """(header, trace id, parent span id) of a fresh W3C trace context."""
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def model_name(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"]


def check_timings(span: dict[str, Any]) -> None:
    """Phase times are there, >= 0, and within the span (they are the scheduler's share)."""
    attributes = span["attributes"]
    phases = [attributes[f"arbor.{p}_time_s"] for p in ("queue", "prefill", "decode")]
    assert min(phases) >= 0
    duration = (span["end_ns"] - span["start_ns"]) / 1e9
    assert 0 < sum(phases) <= duration + 1e-3, (phases, duration)


def test_native_request_span_is_the_traceparents_child(traced: Any) -> None:
    header, trace_id, parent_id = traceparent()
    params = {"temperature": 0, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True}
    response = httpx.post(
        f"{traced.url}/generate",
        json={"text": PROMPT, "sampling_params": params},
        headers={"traceparent": header},
        timeout=60.0,
    )
    response.raise_for_status()
    meta = response.json()["meta_info"]
    spans = spans_where(traced, {"trace_id": trace_id})
    assert len(spans) == 1, spans
    span, model = spans[0], model_name(traced)
    assert span["parent_span_id"] == parent_id and span["kind"] == "SERVER"
    assert span["name"] == f"text_completion {model}" and span["status"] == "UNSET"
    attributes = span["attributes"]
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == model
    assert attributes["gen_ai.request.max_tokens"] == 8
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.response.id"] == meta["id"]
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["arbor.usage.cached_tokens"] == meta["cached_tokens"]
    assert attributes["http.response.status_code"] == 200
    assert "arbor.program.id" not in attributes
    check_timings(span)
    # The same split the native API reports.
    for phase in ("queue", "prefill", "decode"):
        assert attributes[f"arbor.{phase}_time_s"] == pytest.approx(meta[f"{phase}_time"])


def test_streamed_chat_span_covers_the_stream(traced: Any) -> None:
    header, trace_id, parent_id = traceparent()
    body = {
        "model": model_name(traced),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{traced.url}/v1/chat/completions", json=body, headers={"traceparent": header},
        timeout=60.0,
    ) as response:  # fmt: skip
        chunks = list(sse_payloads(response.iter_lines()))
    usage = chunks[-1]["usage"]
    spans = spans_where(traced, {"trace_id": trace_id})
    assert len(spans) == 1, spans
    span = spans[0]
    attributes = span["attributes"]
    assert span["parent_span_id"] == parent_id
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.response.id"] == chunks[0]["id"]
    assert attributes["gen_ai.request.temperature"] == 0.5
    # The span was made after the stream's generation finished, not when the handler returned
    # (after the first token): it has the whole usage, and the decode time fits in it.
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert attributes["arbor.decode_time_s"] > 0
    check_timings(span)


def test_responses_messages_and_programs_get_spans(traced: Any) -> None:
    header, trace_id, _ = traceparent()
    response = httpx.post(
        f"{traced.url}/v1/responses",
        json={"model": model_name(traced), "input": PROMPT, "max_output_tokens": 4},
        headers={"traceparent": header},
        timeout=60.0,
    )
    response.raise_for_status()
    (span,) = spans_where(traced, {"trace_id": trace_id})
    assert span["attributes"]["gen_ai.operation.name"] == "chat"
    assert span["attributes"]["gen_ai.response.id"] == response.json()["id"]
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 4

    header, trace_id, _ = traceparent()
    body = {
        "model": model_name(traced),
        "max_tokens": 4,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    response = httpx.post(
        f"{traced.url}/v1/messages", json=body, headers={"traceparent": header}, timeout=60.0
    )
    response.raise_for_status()
    (span,) = spans_where(traced, {"trace_id": trace_id})
    assert span["attributes"]["gen_ai.response.id"] == response.json()["id"]
    assert (
        span["attributes"]["gen_ai.usage.output_tokens"]
        == response.json()["usage"]["output_tokens"]
    )

    three = {"max_new_tokens": 3, "ignore_eos": True}
    ops = [{"type": "text", "text": PROMPT}, {"type": "gen", "name": "g", "sampling_params": three}]
    response = httpx.post(f"{traced.url}/program", json={"branches": {"": ops}}, timeout=60.0)
    response.raise_for_status()
    program_id = response.json()["program_id"]
    httpx.delete(f"{traced.url}/program/{program_id}", timeout=10.0)
    (span,) = spans_where(traced, {"arbor.program.id": program_id})
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert span["attributes"]["arbor.generations"] == 1
    check_timings(span)


def test_only_generation_requests_get_spans_and_a_root_without_traceparent(traced: Any) -> None:
    rid = f"untraced-{secrets.token_hex(4)}"
    assert httpx.get(f"{traced.url}/health", timeout=10.0).status_code == 200
    assert httpx.get(f"{traced.url}/metrics", timeout=10.0).status_code == 200
    params = {"max_new_tokens": 2}
    httpx.post(
        f"{traced.url}/generate", json={"text": PROMPT, "rid": rid, "sampling_params": params},
        timeout=60.0,
    ).raise_for_status()  # fmt: skip
    (span,) = spans_where(traced, {"gen_ai.response.id": rid})
    assert span["parent_span_id"] is None
    paths = {s["attributes"]["url.path"] for s in spans_where(traced, {}, count=0)}
    assert "/health" not in paths and "/metrics" not in paths


def test_an_unreachable_collector_costs_one_warning(tiny_model_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens; /v1/traces is added
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        server = ServerProcess(tiny_model_path, *POOL, "--otlp-traces-endpoint", endpoint)
    with server:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}

        def answered() -> bool:
            return httpx.post(f"{server.url}/generate", json=body, timeout=60.0).status_code == 200

        assert all(answered() for _ in range(3))
        deadline = time.monotonic() + SPAN_WAIT_S
        while "could not export" not in server.log_path.read_text():
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.2)
        assert all(answered() for _ in range(3))
        time.sleep(4.0)  # the next export's retries give up within the exporter's 5 s timeout
        log = server.log_path.read_text()
        assert log.count("could not export") == 1, log
        assert "Traceback" not in log and f"{endpoint}/v1/traces" in log


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Everything ``arbor serve`` imports, and a server state's tracing set up without the
    flag, leave the OpenTelemetry SDK, its exporter and Arbor's otel module unimported.
    (FastAPI itself imports the opentelemetry API package, which does nothing without an SDK.)"""
    script = (
        "import sys\n"
        "import runtime.cli, runtime.server.launcher, runtime.server.dp_launcher\n"
        "from runtime.server.tracing import open_span_sink\n"
        "assert open_span_sink(None) is None\n"
        "heavy = ('opentelemetry.sdk', 'opentelemetry.exporter', 'runtime.server.otel')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert found.stdout.strip() == "[]", found.stdout


class _Failing(SpanExporter):
    def __init__(self, raises: bool) -> None:
        self.raises, self.calls = raises, 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        if self.raises:
            raise ConnectionError("refused")
        return SpanExportResult.FAILURE


@pytest.mark.parametrize("raises", [False, True])
def test_failed_exports_warn_once(raises: bool, caplog: pytest.LogCaptureFixture) -> None:
    inner = _Failing(raises)
    exporter = WarnOnceExporter(inner, "http://collector:4318/v1/traces")
    with caplog.at_level(logging.WARNING, logger="runtime.server.otel"):
        results = [exporter.export([]) for _ in range(5)]
    assert inner.calls == 5 and set(results) == {SpanExportResult.FAILURE}
    warnings = [r for r in caplog.records if "could not export" in r.getMessage()]
    assert len(warnings) == 1
    assert ("ConnectionError: refused" in warnings[0].getMessage()) == raises


def test_endpoint_urls() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerArgs(model_path="unused", otlp_traces_endpoint="collector:4318")

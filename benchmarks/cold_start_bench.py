"""Cold start: the first requests after ``/health`` against the next three.

For each kind of request (a plain chat, and a chat offering tools under ``tool_choice:
"auto"``) a fresh ``arbor serve`` is started on a free loopback port, and four requests of that
kind are sent one after another, each with its own question (no prompt reuse through the
cache): the first one's latency against the median of the other three. A server that warms up
before it says ready keeps the ratio near 1.

    python -m benchmarks.cold_start_bench                       # the built-in model
    python -m benchmarks.cold_start_bench --model-path FILE.gguf --out cold.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import httpx

from benchmarks.common import print_table, write_json
from runtime.server import ServerProcess
from tests.tool_fixtures import function_tool

QUESTIONS = (
    "What is the weather in Paris?",
    "Is it raining in Oslo right now?",
    "Name a famous painting by Monet.",
    "How hot is it in Lima today?",
)
WEATHER_TOOL = function_tool(
    "get_weather", {"city": {"type": "string"}}, "Get the current weather in a city.", closed=False
)
KINDS = ("chat", "tools_auto")
MAX_TOKENS = 16


def request_body(kind: str, question: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    if kind == "tools_auto":
        body.update(tools=[WEATHER_TOOL], tool_choice="auto")
    return body


def measure(kind: str, model_path: str | None, serve_args: list[str]) -> dict[str, Any]:
    """Start a server, time the four requests of ``kind``; the server's startup log lines
    (``startup:``) come back with the times."""
    start = time.perf_counter()
    with ServerProcess(model_path, *serve_args, "--log-level", "info") as server:
        ready_s = time.perf_counter() - start
        latencies = []
        with httpx.Client(base_url=server.url, timeout=120.0) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for question in QUESTIONS:
                body = {**request_body(kind, question), "model": model}
                sent = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - sent)
                response.raise_for_status()
        startup = [line for line in server.log_text().splitlines() if "startup:" in line]
    warm = statistics.median(latencies[1:])
    return {
        "kind": kind,
        "ready_s": ready_s,
        "first_s": latencies[0],
        "next_three_s": latencies[1:],
        "warm_median_s": warm,
        "ratio": latencies[0] / warm,
        "startup_log": startup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--kind", choices=KINDS, action="append", help="default: both")
    parser.add_argument("--out", default=None)
    parser.add_argument("serve_args", nargs="*", help="more `arbor serve` flags, after --")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    results = [measure(kind, args.model_path, args.serve_args) for kind in args.kind or KINDS]
    load_after = os.getloadavg()[0]
    print_table(
        ["request", "ready s", "first s", "next three median s", "first / median"],
        [[r["kind"], r["ready_s"], r["first_s"], r["warm_median_s"], r["ratio"]] for r in results],
    )
    for result in results:
        for line in result["startup_log"]:
            print(f"{result['kind']}: {line.split('startup:', 1)[1].strip()}")
    print(f"load average before {load_before:.2f}, after {load_after:.2f}")
    write_json(
        "cold_start",
        {
            "model_path": args.model_path or "built-in",
            "load_before": load_before,
            "load_after": load_after,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()

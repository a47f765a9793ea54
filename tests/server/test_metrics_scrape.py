"""``/metrics`` as a gateway's endpoint picker and Prometheus read it: valid exposition text,
the queue and KV-utilization gauges, and the prefix-cache token counters."""

from __future__ import annotations

import re

import httpx
import pytest

from runtime.server import ServerProcess

SHARED_PREFIX = (
    "You are a careful assistant. Answer in one short sentence, using plain words and no "
    "lists, and never repeat the question back to the user. The question follows. "
)
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABELS = r'\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\}'
_SAMPLE = re.compile(rf"({_NAME})({_LABELS})? (\S+)")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def parse_exposition(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """(family name -> type, sample name with labels -> value) of Prometheus text format 0.0.4,
    asserting what a scraper relies on: every family has one HELP then one TYPE line before its
    samples, every sample belongs to a declared family, counters end in ``_total``, values are
    numbers, and no sample repeats."""
    types: dict[str, str] = {}
    helped: set[str] = set()
    samples: dict[str, float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(_NAME, name) and name not in helped, line
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helped and name not in types, f"TYPE without HELP first: {line}"
            assert kind in ("counter", "gauge", "histogram"), line
            if kind == "counter":
                assert name.endswith("_total"), f"a counter not named *_total: {name}"
            types[name] = kind
        else:
            match = _SAMPLE.fullmatch(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            if name not in types:
                cut = (name[: -len(end)] for end in _HISTOGRAM_SUFFIXES if name.endswith(end))
                family = next(cut, "")
                assert types.get(family) == "histogram", f"sample of no declared family: {line}"
            key = name + (labels or "")
            assert key not in samples, f"repeated sample: {line}"
            samples[key] = float(value)
    return types, samples


def scrape(server: ServerProcess) -> tuple[dict[str, str], dict[str, float]]:
    response = httpx.get(f"{server.url}/metrics", timeout=10.0)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return parse_exposition(response.text)


def generate(server: ServerProcess, text: str) -> dict:
    body = {"text": text, "sampling_params": PARAMS}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60.0)
    response.raise_for_status()
    return response.json()


def test_gateway_gauges_and_prefix_cache_counters(server: ServerProcess) -> None:
    httpx.post(f"{server.url}/flush_cache", timeout=30.0).raise_for_status()
    _, before = scrape(server)
    first = generate(server, SHARED_PREFIX + "What is the capital of France?")
    repeat = generate(server, SHARED_PREFIX + "What colour is the sky?")
    assert repeat["meta_info"]["cached_tokens"] > 0  # the shared prefix came from the cache
    types, after = scrape(server)

    # The endpoint picker's two gauges.
    assert types["arbor_num_queue_reqs"] == "gauge"
    assert types["arbor_kv_cache_utilization"] == "gauge"
    for gauge in ("arbor_kv_cache_utilization", "arbor_kv_usage", "arbor_cache_hit_rate"):
        assert 0.0 <= after[gauge] <= 1.0, (gauge, after[gauge])
    assert after["arbor_num_queue_reqs"] == 0  # nothing waits once both have answered
    # Nothing runs now, but the radix cache holds both prompts: the pool is not all free,
    # while the running-requests-only gauge is back to 0.
    assert after["arbor_kv_usage"] == 0.0
    pool = after["arbor_max_total_tokens"]
    assert after["arbor_kv_cache_utilization"] == pytest.approx(
        after["arbor_kv_cached_tokens"] / pool, abs=2 / pool
    )
    assert after["arbor_kv_cache_utilization"] > 0.0

    # Prefix-cache counters, in tokens.
    queries = "arbor_prefix_cache_queries_tokens_total"
    hits = "arbor_prefix_cache_hits_tokens_total"
    assert types[queries] == types[hits] == "counter"
    asked = after[queries] - before.get(queries, 0.0)
    found = after[hits] - before.get(hits, 0.0)
    prompts = first["meta_info"]["prompt_tokens"] + repeat["meta_info"]["prompt_tokens"]
    assert asked == prompts
    assert found == first["meta_info"]["cached_tokens"] + repeat["meta_info"]["cached_tokens"]
    assert 0 < found <= asked
    assert after[hits] <= after[queries]

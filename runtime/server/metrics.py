"""``/metrics``: Prometheus text format, from what the server process sees of each request plus
the scheduler's gauges. No client library: counters and histograms are a few dicts."""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

from runtime.api_keys import tenant_label
from runtime.errors import RequestError
from runtime.histogram import Histogram
from runtime.tokenizer_manager import RequestOutput

PREFIX = "arbor_"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECENT_SAMPLES = 2000

# Scheduler gauges exported from ``server_info``: (key, metric name, help).
SCHEDULER_GAUGES = (
    ("num_running_reqs", "num_running_reqs", "Requests in the running batch."),
    ("num_waiting_reqs", "num_queue_reqs", "Requests waiting for admission."),
    ("kv_usage", "kv_usage", "Fraction of the KV pool held by running requests."),
    (
        "kv_cache_utilization",
        "kv_cache_utilization",
        "Fraction of the KV pool in use (running requests and the radix cache): 1 - free/pool.",
    ),
    ("kv_used_tokens", "kv_used_tokens", "KV slots held by running requests."),
    ("kv_cached_tokens", "kv_cached_tokens", "KV slots held by the radix cache."),
    ("max_total_tokens", "max_total_tokens", "Capacity of the KV pool in tokens."),
    ("cache_hit_rate", "cache_hit_rate", "Prompt tokens served from the cache / prompt tokens."),
    ("gen_throughput", "gen_throughput", "Generated tokens per second since start."),
    (
        "spec_accept_len",
        "spec_accept_len",
        "Mean tokens a request gets from one forward (1.0 without drafts).",
    ),
    ("kv_disk_used_bytes", "kv_disk_used_bytes", "Bytes of KV chunks the disk tier holds."),
)
# Scheduler counters exported from ``server_info``: (key, metric name, help).
SCHEDULER_COUNTERS = (
    ("spec_draft_tokens", "spec_draft_tokens_total", "Speculative draft tokens proposed."),
    ("spec_accepted_tokens", "spec_accepted_tokens_total", "Speculative draft tokens accepted."),
    ("spec_verify_steps", "spec_verify_steps_total", "Request steps that verified a draft."),
    ("draft_tokens_proposed", "jump_forward_tokens_total", "Jump-forward tokens proposed."),
    ("draft_tokens_accepted", "jump_forward_accepted_tokens_total", "Jump-forward tokens kept."),
    (
        "prefix_cache_queries_tokens",
        "prefix_cache_queries_tokens_total",
        "Prompt tokens looked up in the prefix (radix) cache.",
    ),
    (
        "prefix_cache_hits_tokens",
        "prefix_cache_hits_tokens_total",
        "Prompt tokens found in the prefix (radix) cache.",
    ),
    (
        "kv_disk_hits_tokens",
        "kv_disk_hits_tokens_total",
        "Prompt tokens loaded from the KV disk tier instead of recomputed.",
    ),
    ("kv_disk_loads", "kv_disk_loads_total", "KV chunks loaded from the disk tier."),
    ("kv_disk_load_bytes", "kv_disk_load_bytes_total", "Bytes loaded from the KV disk tier."),
    (
        "kv_disk_load_seconds",
        "kv_disk_load_seconds_total",
        "Seconds spent loading KV chunks from the disk tier.",
    ),
    ("kv_disk_writes", "kv_disk_writes_total", "KV chunks written to the disk tier."),
    ("kv_disk_write_bytes", "kv_disk_write_bytes_total", "Bytes written to the KV disk tier."),
    (
        "kv_disk_write_errors",
        "kv_disk_write_errors_total",
        "Failed writes to the KV disk tier (the first disables writing).",
    ),
)
# Per replica of a routed server (``server_info["replicas"]``), labelled by replica index.
REPLICA_GAUGES = (
    ("alive", "Whether the replica serves (1) or is down (0)."),
    ("cache_hit_rate", "The replica's prompt tokens served from its cache / prompt tokens."),
    ("kv_usage", "Fraction of the replica's KV pool held by running requests."),
    ("kv_cache_utilization", "Fraction of the replica's KV pool in use (requests and cache)."),
    ("num_running_reqs", "Requests in the replica's running batch."),
    ("num_waiting_reqs", "Requests waiting in the replica's queue."),
    ("in_flight", "Requests the router sent to the replica that have not finished."),
    ("restarts", "Times the replica was restarted."),
)


class ServerMetrics:
    """Counters and latency histograms over every generation request the server runs.

    Requests are observed through ``observe`` (which wraps the tokenizer manager's result
    stream); streams must deliver chunks as tokens arrive for the latency histograms to mean
    time-to-first-token and inter-token latency.
    """

    def __init__(self) -> None:
        self.finished: Counter[str] = Counter()  # by finish reason type, "error" for refusals
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # The latest samples, for percentiles over recent traffic (the dashboard).
        self.recent_ttft: deque[float] = deque(maxlen=RECENT_SAMPLES)
        self.recent_itl: deque[float] = deque(maxlen=RECENT_SAMPLES)
        # With --api-keys-file, by tenant label (``tenant_label``): requests, prompt tokens and
        # prompt tokens served from the cache.
        self.tenant_requests: Counter[str] = Counter()
        self.tenant_prompt_tokens: Counter[str] = Counter()
        self.tenant_cached_tokens: Counter[str] = Counter()

    async def observe(
        self, stream: AsyncIterator[RequestOutput], tenant: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Pass ``stream``'s chunks through, timing them and counting the request when it ends
        (finished, refused: "error", or cancelled because the client left: "abort"), for
        ``tenant`` too when it has one."""
        start = last = time.monotonic()
        seen_tokens = 0
        last_output: RequestOutput | None = None
        outcome = "abort"
        try:
            async for chunk in stream:
                now = time.monotonic()
                last_output = chunk
                new_tokens = chunk.completion_tokens - seen_tokens
                if new_tokens > 0:
                    if seen_tokens == 0:
                        self.ttft.observe(now - start)
                        self.recent_ttft.append(now - start)
                    else:  # a chunk of k tokens: k gaps of equal share
                        gap = (now - last) / new_tokens
                        for _ in range(new_tokens):
                            self.itl.observe(gap)
                        self.recent_itl.extend(itertools.repeat(gap, new_tokens))
                    seen_tokens, last = chunk.completion_tokens, now
                yield chunk
            reason = last_output and last_output.finish_reason
            outcome = reason.type if reason else "unknown"
        except RequestError:
            outcome = "error"
            raise
        finally:
            self.finished[outcome] += 1
            if last_output is not None:
                self.prompt_tokens += last_output.prompt_tokens
                self.cached_tokens += last_output.cached_tokens
                self.generation_tokens += last_output.completion_tokens
            if tenant is not None:
                self._count_tenant(tenant_label(tenant), last_output)
            if outcome != "error":
                self.e2e.observe(time.monotonic() - start)

    def _count_tenant(self, label: str, last_output: RequestOutput | None) -> None:
        self.tenant_requests[label] += 1
        if last_output is not None:
            self.tenant_prompt_tokens[label] += last_output.prompt_tokens
            self.tenant_cached_tokens[label] += last_output.cached_tokens

    def recent_percentiles(self) -> dict[str, dict[str, float] | None]:
        """p50/p90/p99 in seconds of the last RECENT_SAMPLES time-to-first-token and
        inter-token latency samples (None before the first sample)."""
        return {"ttft": _percentiles(self.recent_ttft), "itl": _percentiles(self.recent_itl)}

    def render(
        self,
        scheduler_info: dict[str, Any] | None,
        tool_thresholds: Mapping[str, int] | None = None,
    ) -> str:
        """The exposition text; scheduler gauges are left out when ``scheduler_info`` is None.
        ``tool_thresholds``: how many tool-decision thresholds were set, by where from
        (``ToolDecider.sources``)."""
        p = PREFIX
        lines = [
            f"# HELP {p}requests_total Generation requests finished, by finish reason.",
            f"# TYPE {p}requests_total counter",
        ]
        for reason, count in sorted(self.finished.items()):
            lines.append(f'{p}requests_total{{finish_reason="{reason}"}} {count}')
        for name, value, help_text in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
            ("cached_tokens_total", self.cached_tokens, "Prompt tokens served from the cache."),
            ("generation_tokens_total", self.generation_tokens, "Generated tokens."),
        ):
            lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} counter"]
            lines.append(f"{p}{name} {value}")
        lines += self._tenant_lines()
        lines += _tenant_cache_lines(scheduler_info or {})
        lines += self.ttft.render(f"{p}time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.render(f"{p}inter_token_latency_seconds", "Time between tokens.")
        lines += self.e2e.render(f"{p}e2e_request_latency_seconds", "Request latency.")
        for kind, metrics in (("gauge", SCHEDULER_GAUGES), ("counter", SCHEDULER_COUNTERS)):
            for key, name, help_text in metrics:
                reading = (scheduler_info or {}).get(key)
                if isinstance(reading, (int, float)):
                    lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}"]
                    lines.append(f"{p}{name} {float(reading)}")
        compile_times = (scheduler_info or {}).get("grammar_compile_seconds")
        if isinstance(compile_times, dict):
            lines += Histogram.from_dict(compile_times).render(
                f"{p}grammar_compile_seconds",
                "Seconds a constrained request waited for its grammar to be prepared and "
                "compiled (grammars already in the compile cache are not counted).",
            )
        if tool_thresholds:
            name = f"{p}tool_thresholds_total"
            lines += [
                f"# HELP {name} Tool-decision thresholds set, by source: calibrated at startup, "
                "read from the cache folder, or calibrated on a request's demand.",
                f"# TYPE {name} counter",
            ]
            for source, count in sorted(tool_thresholds.items()):
                lines.append(f'{name}{{source="{source}"}} {count}')
        lines += _routed_lines(
            (scheduler_info or {}).get("replicas"), (scheduler_info or {}).get("router")
        )
        return "\n".join(lines) + "\n"

    def _tenant_lines(self) -> list[str]:
        """The per-tenant counters, labelled by the tenant name's hash (none without tenants)."""
        p, lines = PREFIX, []
        if not self.tenant_requests:
            return []
        for name, counts, help_text in (
            ("tenant_requests_total", self.tenant_requests, "Generation requests finished."),
            ("tenant_prompt_tokens_total", self.tenant_prompt_tokens, "Prompt tokens."),
            (
                "tenant_cached_tokens_total",
                self.tenant_cached_tokens,
                "Prompt tokens served from the tenant's cache.",
            ),
        ):
            lines.append(f"# HELP {p}{name} {help_text} By tenant.")
            lines.append(f"# TYPE {p}{name} counter")
            for label in sorted(self.tenant_requests):
                lines.append(f'{p}{name}{{tenant="{label}"}} {counts[label]}')
        return lines


# The scheduler's per-tenant readings of its radix cache (``server_info``): (key, metric name,
# kind, help).
TENANT_CACHE_METRICS = (
    ("tenant_kv_cached_tokens", "tenant_kv_cached_tokens", "gauge", "KV tokens cached."),
    (
        "tenant_kv_evicted_tokens",
        "tenant_evicted_tokens_total",
        "counter",
        "Cached KV tokens evicted from the radix cache (back to 0 when the cache is flushed).",
    ),
)


def _tenant_cache_lines(scheduler_info: Mapping[str, Any]) -> list[str]:
    """The radix cache's tokens by tenant label, cached and evicted (none without tenants)."""
    p, lines = PREFIX, []
    for key, name, kind, help_text in TENANT_CACHE_METRICS:
        counts = scheduler_info.get(key)
        if not isinstance(counts, dict):
            continue
        lines += [f"# HELP {p}{name} {help_text} By tenant.", f"# TYPE {p}{name} {kind}"]
        for label in sorted(counts):
            lines.append(f'{p}{name}{{tenant="{label}"}} {counts[label]}')
    return lines


def _routed_lines(replicas: Any, router: Any) -> list[str]:
    """A routed server's per-replica gauges and router counters (none for a single engine)."""
    p, lines = PREFIX, []
    if isinstance(replicas, list):
        for key, help_text in REPLICA_GAUGES:
            lines += [f"# HELP {p}replica_{key} {help_text}", f"# TYPE {p}replica_{key} gauge"]
            for row in replicas:
                value = row.get(key)
                if isinstance(value, (bool, int, float)):
                    lines.append(f'{p}replica_{key}{{replica="{row["replica"]}"}} {float(value)}')
    if isinstance(router, dict):
        name = f"{p}router_decisions_total"
        lines += [f"# HELP {name} Routing decisions by reason.", f"# TYPE {name} counter"]
        for decision, count in sorted(router.get("decisions", {}).items()):
            lines.append(f'{name}{{decision="{decision}"}} {count}')
        name = f"{p}router_routed_total"
        lines += [f"# HELP {name} Requests routed to each replica.", f"# TYPE {name} counter"]
        for index, count in enumerate(router.get("routed", [])):
            lines.append(f'{name}{{replica="{index}"}} {count}')
        for key, help_text in (
            ("retried_requests", "Requests re-sent to another replica after theirs died."),
            ("failed_over_requests", "Requests lost with a replica (failed with 503)."),
        ):
            lines += [f"# HELP {p}router_{key}_total {help_text}"]
            lines += [f"# TYPE {p}router_{key}_total counter"]
            lines.append(f"{p}router_{key}_total {router.get(key, 0)}")
    return lines


def _percentiles(samples: deque[float]) -> dict[str, float] | None:
    if not samples:
        return None
    ordered = sorted(samples)
    last = len(ordered) - 1
    return {f"p{q}": ordered[round(last * q / 100)] for q in (50, 90, 99)}

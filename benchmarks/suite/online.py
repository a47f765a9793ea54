"""Online mode: Poisson arrivals of streaming clients against a real ``arbor serve``.

Requests come from a request-list workload (the same prompts and output lengths as offline)
and are sent to the native ``POST /generate`` with ``stream``, each on its own connection at
its arrival time. The run is bounded by the number of requests and by ``max_seconds``:
requests still running at the deadline are cancelled (the server aborts them) and count as
failures; requests not yet sent are not sent.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import write_json
from benchmarks.suite import report
from benchmarks.suite.contention import others_share, sample
from benchmarks.suite.metrics import optimal_hit_rate, summarize
from benchmarks.suite.systems.arbor import Request
from benchmarks.suite.trace import Call, Clock, SystemRun, Timing
from benchmarks.suite.workloads import create_workload
from benchmarks.suite.workloads.base import RequestListWorkload
from runtime.server import ServerProcess


@dataclass(frozen=True)
class OnlineConfig:
    """``rate`` requests/s on average (Poisson); SLOs for goodput: a request is good when it
    completed, its TTFT is at most ``slo_ttft_s`` and its mean ITL at most ``slo_itl_ms``."""

    rate: float
    max_seconds: float = 300.0
    slo_ttft_s: float = 2.0
    slo_itl_ms: float = 200.0
    seed: int = 0


@dataclass
class ClientResult:
    request: Request
    timing: Timing
    output_ids: tuple[int, ...] = ()
    completed: bool = False
    error: str | None = None


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of ``count`` requests: exponential gaps of mean 1/rate, seeded."""
    if rate <= 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


async def stream_generate(
    client: httpx.AsyncClient, request: Request, clock: Clock, result: ClientResult
) -> None:
    """One streamed native /generate; fills ``result`` as tokens arrive (so a cancelled
    request keeps what it got)."""
    body = {
        "input_ids": list(request.prompt_ids),
        "sampling_params": request.sampling_params,
        "stream": True,
    }
    async with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                result.error = str(event["error"])
                return
            now = clock()
            ids = event["output_ids"]
            result.timing.token_times.extend([now] * (len(ids) - len(result.output_ids)))
            result.output_ids = tuple(ids)
    result.timing.finish = clock()
    result.completed = True


async def drive(url: str, requests: list[Request], config: OnlineConfig) -> list[ClientResult]:
    """Send ``requests`` at Poisson times; return one result per request that was sent."""
    arrivals = poisson_arrivals(len(requests), config.rate, config.seed)
    limits = httpx.Limits(max_connections=len(requests) + 1)
    timeout = httpx.Timeout(config.max_seconds + 60, connect=10.0)
    results: list[ClientResult] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        clock = Clock()
        with tqdm(total=len(requests), desc="arbor serve", unit="req", leave=False) as bar:

            async def client_task(request: Request, at: float) -> None:
                await asyncio.sleep(max(0.0, at - clock()))
                result = ClientResult(request, Timing(arrival=clock()))
                results.append(result)
                try:
                    await stream_generate(client, request, clock, result)
                except httpx.HTTPError as exc:
                    result.error = f"{type(exc).__name__}: {exc}"
                bar.update(1)

            tasks = [
                asyncio.create_task(client_task(r, at))
                for r, at in zip(requests, arrivals, strict=True)
            ]
            _, pending = await asyncio.wait(tasks, timeout=config.max_seconds)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        if not result.completed and result.error is None:
            result.error = f"cancelled at the {config.max_seconds:g} s deadline"
    return results


def summarize_online(
    results: list[ClientResult],
    config: OnlineConfig,
    cache_hit_rate: float | None,
    other_cpu_share: float | None = None,
) -> dict[str, Any]:
    """Latency and throughput over completed requests, plus sent/completed/failed counts and
    goodput (the fraction of sent requests that met both SLOs, and those per second).
    ``other_cpu_share``: what processes other than the client and the server's used."""
    done = [r for r in results if r.completed]
    start = min((r.timing.arrival for r in results), default=0.0)
    end = max((r.timing.finish for r in done), default=start)
    run = SystemRun(
        system="arbor serve",
        calls=[Call(r.request.prompt_ids, r.output_ids, i) for i, r in enumerate(done)],
        timings=[r.timing for r in done],
        outputs=[r.output_ids for r in done],
        wall_s=end - start,
        cache_hit_rate=cache_hit_rate,
        note=f"Poisson arrivals at {config.rate:g} req/s, streaming native /generate",
        other_cpu_share=other_cpu_share,
    )
    good = [r for r in done if _meets_slo(r.timing, config)]
    errors = sorted({r.error for r in results if r.error})
    return {
        **summarize(run),
        "sent": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "goodput": len(good) / len(results) if results else 0.0,
        "good_requests_per_s": len(good) / run.wall_s if run.wall_s > 0 else 0.0,
    }


def _meets_slo(timing: Timing, config: OnlineConfig) -> bool:
    if not timing.token_times:
        return False
    ttft = timing.token_times[0] - timing.arrival
    gaps = len(timing.token_times) - 1
    mean_itl = (timing.token_times[-1] - timing.token_times[0]) / gaps if gaps else 0.0
    return ttft <= config.slo_ttft_s and mean_itl * 1000 <= config.slo_itl_ms


def run_serve(args: argparse.Namespace, model_path: str, argv: list[str]) -> int:
    """``arbor bench serve``: start the server, warm it up, flush its cache, drive it, print
    the table, write JSON (and a chart), and stop the server whatever happens."""
    from runtime.model_files import load_tokenizer

    workload = create_workload(args.requests_from, args.quick, args.requests, args.seed)
    assert isinstance(workload, RequestListWorkload)
    requests = workload.requests(load_tokenizer(model_path))
    config = OnlineConfig(
        rate=args.rate,
        max_seconds=args.max_seconds or (120.0 if args.quick else 300.0),
        slo_ttft_s=args.slo_ttft,
        slo_itl_ms=args.slo_itl,
        seed=args.seed,
    )
    load_before = os.getloadavg()
    serve_args = ("--dtype", args.dtype, "--quantization", args.quantization,
                  "--max-total-tokens", str(args.max_total_tokens))  # fmt: skip
    with ServerProcess(model_path, *serve_args) as server:
        httpx.post(
            f"{server.url}/generate",
            json={"input_ids": [10, 11, 12, 13], "sampling_params": {"max_new_tokens": 2}},
            timeout=60.0,
        ).raise_for_status()
        httpx.post(f"{server.url}/flush_cache", timeout=30.0).raise_for_status()
        before = httpx.get(f"{server.url}/get_server_info", timeout=30.0).json()
        pids = server.pids(before)
        start = sample(pids)
        results = asyncio.run(drive(server.url, requests, config))
        busy = others_share(start, sample(pids))
        after = httpx.get(f"{server.url}/get_server_info", timeout=30.0).json()
    load_after = os.getloadavg()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    hit_rate = (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt else None
    summary = summarize_online(results, config, hit_rate, busy)
    print(f"\nserve ({workload.name} requests at {config.rate:g} req/s): {model_path}")
    print(
        f"load average before {report.format_load(load_before)}, after "
        f"{report.format_load(load_after)}\n"
    )
    optimal = optimal_hit_rate(_calls(requests))
    report.print_systems([summary], optimal)
    print(
        f"sent {summary['sent']}, completed {summary['completed']}, failed {summary['failed']}; "
        f"goodput {summary['goodput']:.1%} (TTFT <= {config.slo_ttft_s:g} s and mean ITL <= "
        f"{config.slo_itl_ms:g} ms), {summary['good_requests_per_s']:.2f} good req/s"
    )
    for error in summary["errors"]:
        print(f"  error: {error}")
    payload = {
        "command": ["arbor", "bench", *argv],
        "model_path": model_path,
        "workload": workload.describe(),
        "online": dataclasses.asdict(config),
        "load_average": {"before": load_before, "after": load_after},
        "optimal_hit_rate": optimal,
        "systems": [summary],
    }
    write_json(f"bench-serve-{workload.name}", payload, args.out)
    if args.plot:
        report.plot(args.plot, f"serve, {config.rate:g} req/s ({workload.name})", [summary])
    return 0 if summary["completed"] else 1


def _calls(requests: list[Request]) -> list[Call]:
    """The requests as calls with no output (online arrivals overlap, so outputs of earlier
    requests are not counted as reusable)."""
    return [Call(r.prompt_ids, ()) for r in requests]

"""Data parallelism: ``arbor serve --dp N`` with each routing policy, in the same run.

For each workload (``arbor bench``'s ``multi-turn`` and ``tree-of-thought`` by default) a
single-engine server runs it first (the hit-rate reference), then a ``--dp N`` server per
routing policy, each freshly started, all driven over HTTP by the same workload code
(``benchmarks/suite/systems/http_engine.py``). Reported per run: output tokens/s, the cache hit
rate (cached / prompt tokens, summed over replicas), TTFT p50/p99, and the router's decisions.
Targets (issue 13): ``cache_aware`` >= 1.3x ``round_robin`` throughput and within 5 points of
the single engine's hit rate.

    python -m benchmarks.dp_bench [--model-path DIR] [--dp 2] [--quick] [--repeats R]
        [--kv-tokens-per-replica N] [--workloads multi-turn,tree-of-thought]
        [--policies cache_aware,round_robin,shortest_queue,random]

``--repeats R`` runs every system R times, interleaved, and reports each one's best run (all
runs' tok/s are in the JSON). ``--kv-tokens-per-replica N`` caps each replica's KV pool at N
tokens and the single engine's at dp x N (the same memory in all): the regime routing exists
for, where the working set is more than one replica holds.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import print_table, write_json
from benchmarks.suite.metrics import percentile, summarize, ttfts
from benchmarks.suite.systems.http_engine import HttpEngine
from benchmarks.suite.workloads import create_workload
from runtime.server import ServerProcess
from runtime.server_args import ROUTING_POLICIES
from runtime.test_model import cached_test_model


def run_one(
    model_path: str, workload_name: str, quick: bool, serve_args: list[str]
) -> dict[str, Any]:
    workload = create_workload(workload_name, quick)
    with ServerProcess(
        model_path, *serve_args, startup_timeout_s=300.0, stop_timeout_s=60.0
    ) as server:
        engine = HttpEngine(server.url, model_path)
        try:
            run = workload.run_arbor(engine)  # type: ignore[arg-type]
            info = engine.get_server_info()
        finally:
            engine.close()
    summary = summarize(run)
    first = ttfts(run.timings)
    return {
        "tokens_per_s": summary["output_tokens_per_s"],
        "hit_rate": run.cache_hit_rate,
        "ttft_p50_s": percentile(first, 50),
        "ttft_p99_s": percentile(first, 99),
        "wall_s": run.wall_s,
        "router": info.get("router"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the small test model")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="multi-turn,tree-of-thought")
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES))
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per system, interleaved (single, each policy, then again); the best is reported",
    )
    parser.add_argument(
        "--kv-tokens-per-replica",
        type=int,
        default=None,
        help="each replica's KV pool in tokens (--max-total-tokens); the single engine gets dp "
        "times it, the same memory in all (default: the server's own sizing)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    model_path = args.model_path or str(cached_test_model("small"))
    kv = args.kv_tokens_per_replica
    systems: dict[str, list[str]] = {
        "single": [] if kv is None else ["--max-total-tokens", str(args.dp * kv)]
    }
    for policy in args.policies.split(","):
        systems[policy] = ["--dp", str(args.dp), "--router-policy", policy]
        systems[policy] += [] if kv is None else ["--max-total-tokens", str(kv)]
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for name in args.workloads.split(","):
        runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
        for _ in range(args.repeats):
            for system, serve in systems.items():
                runs[system].append(run_one(model_path, name, args.quick, serve))
        results[name] = {}
        for system, attempts in runs.items():
            best = max(attempts, key=lambda r: r["tokens_per_s"])
            results[name][system] = {
                **best,
                "all_tokens_per_s": [r["tokens_per_s"] for r in attempts],
            }
        single = results[name]["single"]
        round_robin = results[name].get("round_robin")
        for system, r in results[name].items():
            ratio = r["tokens_per_s"] / round_robin["tokens_per_s"] if round_robin else None
            rows.append(
                [
                    name,
                    system if system == "single" else f"dp{args.dp} {system}",
                    f"{r['tokens_per_s']:.0f}",
                    "-" if ratio is None else f"{ratio:.2f}x",
                    f"{100 * (r['hit_rate'] or 0):.1f}%",
                    f"{100 * ((r['hit_rate'] or 0) - (single['hit_rate'] or 0)):+.1f}",
                    f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
                ]
            )
    print_table(
        [
            "workload",
            "system",
            "tok/s",
            "/ round_robin",
            "hit rate",
            "vs single (pts)",
            "TTFT p50/p99 s",
        ],
        rows,
    )
    write_json(
        "dp_bench",
        {
            "model_path": model_path,
            "dp": args.dp,
            "quick": args.quick,
            "repeats": args.repeats,
            "kv_tokens_per_replica": kv,
            "results": results,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Replay a prefix-sharing request trace against RadixCache and report its throughput.

The trace and the replay (benchmarks/radix_replay.py) mix multi-turn chats, few-shot prompts
and parallel samples, driven through the cache the way the scheduler drives it, every cache
call timed; here for each eviction policy and page sizes 1 and 16.

The same replay, page size 1 and LRU, also drives SGLang's pure-Python RadixCache when its
wheel is unpacked in ``--sglang DIR`` (``pip install --no-deps --target DIR sglang``; see
benchmarks/sglang_radix.py), each side given its native ids: numpy int32 arrays here,
``array('q')`` there, the two taking turns ``--repeat`` times (best of each kept). Without it
that comparison is skipped, saying how to get it.

    python -m benchmarks.radix_cache_bench [--quick] [--out PATH] [--sglang DIR] [--repeat N]

Prints tables and writes JSON (default benchmarks/results/radix_cache_bench.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import sglang_radix
from benchmarks.radix_replay import (
    OPS,
    VOCAB,
    Replay,
    TraceRequest,
    make_trace,
    op_summary,
    replay_all,
)
from radix_cache import KVSlotAllocator, RadixCache


def run_replay(trace: list[TraceRequest], num_slots: int, page_size: int, policy: str) -> dict:
    cache = RadixCache(KVSlotAllocator(num_slots, page_size), policy=policy)
    replay = Replay(cache)
    wall = replay_all(replay, trace)
    cache.check_invariants(private_slots=replay.private_slots())  # no slot leaked on the way
    stats = cache.stats()
    return {
        "page_size": page_size,
        "policy": policy,
        "requests": len(trace),
        "cache_ops": sum(replay.timer.calls[op] for op in OPS),
        "wall_s": wall,
        "hit_rate": stats.hit_tokens / max(stats.queried_tokens, 1),
        "evicted_tokens": stats.evicted_tokens,
        "cached_tokens": stats.cached_tokens,
        "nodes": stats.nodes,
        "tree_bytes_per_cached_token": cache.nbytes() / max(stats.cached_tokens, 1),
        "ops": op_summary(replay.timer),
    }


def time_match(cache: RadixCache, ids: np.ndarray | list[int], reps: int) -> float:
    """Median seconds of one match_prefix(ids) call."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        cache.match_prefix(ids)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def match_scaling(reps: int) -> dict:
    """Cost of matching a fully cached 8k-token prompt vs a 100-token one, stored as one node
    and as a 16-turn chat path (16 nodes deep)."""
    rng = np.random.default_rng(1)
    cache = RadixCache(KVSlotAllocator(1 << 16))
    short = rng.integers(1, VOCAB, 100, dtype=np.int32)
    long_flat = rng.integers(1, VOCAB, 8192, dtype=np.int32)
    long_chat = rng.integers(1, VOCAB, 8192, dtype=np.int32)
    for ids in [short, long_flat] + [long_chat[: 512 * (t + 1)] for t in range(16)]:
        slots = cache.allocator.alloc(ids.size)
        assert slots is not None
        cache.allocator.free(slots[: cache.insert(ids, slots)])
    result: dict = {}
    for form, convert in (("numpy", lambda a: a), ("list", lambda a: a.tolist())):
        base = time_match(cache, convert(short), reps)
        flat = time_match(cache, convert(long_flat), reps)
        chat = time_match(cache, convert(long_chat), reps)
        result[form] = {
            "match_100_us": 1e6 * base,
            "match_8k_one_node_us": 1e6 * flat,
            "match_8k_16_nodes_us": 1e6 * chat,
            "ratio_8k_one_node": flat / base,
            "ratio_8k_16_nodes": chat / base,
        }
    return result


def print_tables(results: list[dict], scaling: dict) -> None:
    print(f"{'config':<12} {'op':<13} {'calls':>8} {'ops/s':>10} {'tokens/s':>12} {'mean us':>9}")
    for r in results:
        config = f"ps={r['page_size']} {r['policy']}"
        for op, o in r["ops"].items():
            tokens = f"{o['tokens_per_s']:.3g}" if o["tokens_per_s"] else "-"
            print(
                f"{config:<12} {op:<13} {o['calls']:>8} {o['ops_per_s']:>10.0f} "
                f"{tokens:>12} {o['mean_us']:>9.1f}"
            )
    print()
    print(
        f"{'config':<12} {'requests':>8} {'cache ops':>9} {'wall s':>7} {'hit rate':>8} "
        f"{'evicted tok':>11} {'nodes':>6} {'bytes/cached tok':>16}"
    )
    for r in results:
        config = f"ps={r['page_size']} {r['policy']}"
        print(
            f"{config:<12} {r['requests']:>8} "
            f"{r['cache_ops']:>9} {r['wall_s']:>7.2f} {r['hit_rate']:>8.3f} "
            f"{r['evicted_tokens']:>11} {r['nodes']:>6} {r['tree_bytes_per_cached_token']:>16.1f}"
        )
    print()
    print(
        f"{'match input':<12} {'100 tok us':>10} {'8k 1 node us':>12} {'ratio':>6} "
        f"{'8k 16 nodes us':>14} {'ratio':>6}"
    )
    for form, s in scaling.items():
        print(
            f"{form:<12} {s['match_100_us']:>10.1f} {s['match_8k_one_node_us']:>12.1f} "
            f"{s['ratio_8k_one_node']:>6.1f} {s['match_8k_16_nodes_us']:>14.1f} "
            f"{s['ratio_8k_16_nodes']:>6.1f}"
        )


def compare_with_sglang(
    trace: list[TraceRequest], num_slots: int, root: Path, repeat: int
) -> tuple[dict, dict]:
    """Arbor's page-1 LRU replay and SGLang's on the same trace, taking turns ``repeat`` times;
    each side's fastest run (insert + match seconds) is kept, as other jobs share the CPU."""
    sglang_radix.load(root)  # SGLangUnavailable before any timing

    def fastest(best: dict | None, run: dict) -> dict:
        def cost(r: dict) -> float:
            return float(r["ops"]["match_prefix"]["seconds"] + r["ops"]["insert"]["seconds"])

        return run if best is None or cost(run) < cost(best) else best

    ours: dict | None = None
    theirs: dict | None = None
    for _ in range(repeat):
        ours = fastest(ours, run_replay(trace, num_slots, 1, "lru"))
        theirs = fastest(theirs, sglang_radix.run_replay(trace, num_slots, root))
    assert ours is not None and theirs is not None
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small trace, for smoke tests")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "radix_cache_bench.json",
        help="where to write the JSON results",
    )
    parser.add_argument(
        "--sglang",
        type=Path,
        default=sglang_radix.DEFAULT_DIR,
        help="folder with SGLang's wheel installed without dependencies, for the comparison "
        f"({sglang_radix.INSTALL_HINT.format(dir='DIR')}; default %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="alternate Arbor's and SGLang's replays this many times, keep each one's best",
    )
    args = parser.parse_args()
    num_requests = 3_000 if args.quick else 25_000
    num_slots = 1 << 18  # 262k token slots: far below the trace's working set
    configs = (
        [(1, "lru"), (16, "lru")]
        if args.quick
        else [(1, "lru"), (16, "lru"), (1, "lfu"), (1, "fifo")]
    )
    trace = make_trace(num_requests)
    results = [run_replay(trace, num_slots, ps, policy) for ps, policy in configs]
    scaling = match_scaling(reps=200 if args.quick else 2000)
    print_tables(results, scaling)
    payload: dict[str, Any] = {
        "benchmark": "radix_cache",
        "quick": args.quick,
        "num_slots": num_slots,
        "trace_requests": num_requests,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "replays": results,
        "match_scaling": scaling,
    }
    try:
        ours, theirs = compare_with_sglang(trace, num_slots, args.sglang, args.repeat)
    except sglang_radix.SGLangUnavailable as exc:
        print(f"\nSGLang comparison skipped: {exc}")
        payload["sglang"] = {"skipped": str(exc)}
    else:
        table = sglang_radix.comparison(ours, theirs)
        sglang_radix.print_comparison(ours, theirs, table)
        payload["sglang"] = {
            "repeat": args.repeat,
            "arbor": ours,
            "sglang": theirs,
            "comparison": table,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

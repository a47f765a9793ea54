"""How long a /cache_tree or dashboard snapshot holds the scheduler, on trees of 100k nodes.

The scheduler answers a snapshot request between two steps, so the time it takes is a stall of
every running request. This builds radix trees of three shapes, then times what the scheduler
does per request: ``CacheView.snapshot`` (the best-first walk, ages, evicted nodes, the paths
of the 32 last requests) and pickling the reply for the ZMQ socket.

- ``chat``: multi-turn conversations on 20 system prompts (deep paths, fan-out of hundreds);
- ``wide``: one shared prompt followed by 100k different suffixes (a fan-out of 100k);
- ``trie``: each sequence copies a random prefix of an earlier one (splits everywhere).

``steady``: the requests' paths were found by an earlier snapshot (the dashboard's case, at two
updates a second); ``fresh``: all 32 requests finished since the last snapshot (each path is
found from the node the request had locked, as in the scheduler).

    python -m benchmarks.cache_snapshot_bench [--quick] [--out PATH]

Prints a table and writes JSON (default benchmarks/results/cache_snapshot_bench.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import numpy as np

from radix_cache import KVSlotAllocator, RadixCache, TreeNode
from radix_cache.snapshot import cached_path
from runtime.ipc import ControlReply, encode
from runtime.scheduler.activity_log import RequestRecord
from runtime.scheduler.cache_view import CacheView

VOCAB = 32_000
SHAPES = ("chat", "wide", "trie")
MAX_NODES = (100, 200, 500)
RECENT_REQUESTS = 32
NEW_TOKENS = 40  # of each recent request: the tokens its finish inserted below what it locked


def build_tree(shape: str, num_nodes: int, seed: int = 0) -> tuple[RadixCache, list[np.ndarray]]:
    """A tree of at least ``num_nodes`` nodes, and the last sequences inserted."""
    rng = np.random.default_rng(seed)
    cache = RadixCache(KVSlotAllocator(1 << 24))
    inserted: list[np.ndarray] = []

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, VOCAB, n, dtype=np.int32)

    def insert(ids: np.ndarray) -> None:
        slots = cache.allocator.alloc(ids.size)
        assert slots is not None, "grow the pool"
        cache.allocator.free(slots[: cache.insert(ids, slots)])
        inserted.append(ids)

    systems = [tokens(300) for _ in range(20)]
    conversations: list[np.ndarray] = []
    while cache.stats().nodes < num_nodes:
        if shape == "wide":
            insert(np.concatenate([systems[0], tokens(50)]))
        elif shape == "chat":
            if not conversations or rng.random() < 0.05:
                conversations.append(systems[int(rng.integers(len(systems)))])
            i = int(rng.integers(len(conversations)))
            conversations[i] = np.concatenate([conversations[i], tokens(40)])
            insert(conversations[i])
        else:
            base = inserted[int(rng.integers(len(inserted)))] if inserted else tokens(200)
            insert(np.concatenate([base[: int(rng.integers(1, base.size))], tokens(60)]))
    return cache, inserted[-RECENT_REQUESTS:]


def locked_node(cache: RadixCache, ids: np.ndarray) -> TreeNode | None:
    """The node a request with these tokens would have locked: the deepest one ending within
    its prompt, taken as all but its last NEW_TOKENS tokens."""
    path, _ = cached_path(cache, ids)
    end, locked = 0, None
    for node in path:
        end += node.key.size
        if end > ids.size - NEW_TOKENS:
            break
        locked = node
    return locked


def time_snapshots(
    cache: RadixCache, recent: list[np.ndarray], max_nodes: int, reps: int, fresh: bool
) -> dict:
    view = CacheView(cache)
    records = [
        RequestRecord(f"r{i}", 0.0, 0.0, ids.size, 0, 0, None, ids, locked_node(cache, ids))
        for i, ids in enumerate(recent)
    ]
    view.snapshot(max_nodes, records)  # warm: the paths of the steady case are found here
    build, send = [], []
    gc.collect()
    for _ in range(reps):
        if fresh:
            view._paths = {}
        started = time.perf_counter()
        reply = view.snapshot(max_nodes, records)
        built = time.perf_counter()
        encode(ControlReply("id", reply))
        build.append(built - started)
        send.append(time.perf_counter() - built)
    total = 1e3 * (np.array(build) + np.array(send))
    return {
        "max_nodes": max_nodes,
        "nodes_shown": len(reply["nodes"]),
        "scanned": reply["scanned"],
        "build_ms_median": 1e3 * float(np.median(build)),
        "pickle_ms_median": 1e3 * float(np.median(send)),
        "total_ms_median": float(np.median(total)),
        "total_ms_p99": float(np.percentile(total, 99)),
        "total_ms_max": float(total.max()),
        "payload_bytes": len(encode(ControlReply("id", reply))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20k-node trees, fewer reps")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "cache_snapshot_bench.json",
        help="where to write the JSON results",
    )
    args = parser.parse_args()
    num_nodes = 20_000 if args.quick else 100_000
    reps = 30 if args.quick else 200
    rows = []
    print(
        f"{'shape':<6} {'nodes':>7} {'case':<7} {'max':>4} {'scanned':>7} {'build ms':>8} "
        f"{'pickle ms':>9} {'total ms':>8} {'p99 ms':>7} {'max ms':>7} {'bytes':>7}"
    )
    for shape in SHAPES:
        started = time.perf_counter()
        cache, recent = build_tree(shape, num_nodes)
        built_s = time.perf_counter() - started
        for case in ("steady", "fresh"):
            for max_nodes in MAX_NODES:
                row = time_snapshots(cache, recent, max_nodes, reps, fresh=case == "fresh")
                row.update(shape=shape, case=case, tree_nodes=cache.stats().nodes)
                row["tree_build_s"] = built_s
                rows.append(row)
                print(
                    f"{shape:<6} {row['tree_nodes']:>7} {case:<7} {max_nodes:>4} "
                    f"{row['scanned']:>7} {row['build_ms_median']:>8.3f} "
                    f"{row['pickle_ms_median']:>9.3f} {row['total_ms_median']:>8.3f} "
                    f"{row['total_ms_p99']:>7.3f} {row['total_ms_max']:>7.3f} "
                    f"{row['payload_bytes']:>7}"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "cache_snapshot",
        "quick": args.quick,
        "reps": reps,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

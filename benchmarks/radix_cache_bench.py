"""Replay a prefix-sharing request trace against RadixCache and report its throughput.

The trace mixes multi-turn chats (system prompt + growing history, up to 8k tokens), few-shot
prompts (long shared examples + a short question) and parallel samples of one prompt. Requests
are driven the way the scheduler drives the cache: match, lock, allocate the rest (evicting
under memory pressure), insert the prefill of long prompts early and move the lock, then at
finish insert prompt + output, free duplicates, unlock. Each cache call is timed.

    python benchmarks/radix_cache_bench.py [--quick] [--out PATH]

Prints a table and writes JSON (default benchmarks/results/radix_cache_bench.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from radix_cache import KVSlotAllocator, MatchResult, RadixCache, TreeNode

VOCAB = 32_000
MAX_CONTEXT = 8192
RUNNING = 32  # requests in flight, each holding a lock and private slots
EARLY_INSERT = 2048  # prompts extending more than this insert their prefill before finishing
OPS = ("match_prefix", "insert", "evict", "lock", "unlock")


@dataclass
class TraceRequest:
    prompt: np.ndarray  # (prompt_len,) int32 token ids
    output: np.ndarray  # (output_len,) int32 token ids the request will "generate"


def make_trace(num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """Chats 60%, few-shot 30%, parallel samples (4 outputs of one chat prompt) 10%.

    Few-shot questions come from a pool of 500 with Zipf popularity and get the same answer
    each time (greedy decoding), so some requests recur whole (FAQ-like traffic): the only
    accesses that refresh a leaf without growing it, hence where LRU, LFU and FIFO differ.
    """
    rng = np.random.default_rng(seed)

    def tokens(low: int, high: int) -> np.ndarray:
        return rng.integers(1, VOCAB, size=int(rng.integers(low, high)), dtype=np.int32)

    systems = [tokens(200, 1500) for _ in range(8)]
    templates = [tokens(1000, 3000) for _ in range(6)]
    questions = [tokens(50, 200) for _ in range(500)]
    answers = [tokens(20, 100) for _ in questions]
    chats = [systems[rng.integers(len(systems))] for _ in range(64)]
    trace: list[TraceRequest] = []
    while len(trace) < num_requests:
        kind = rng.random()
        if kind < 0.3:
            question = min(int(rng.zipf(1.2)), len(questions)) - 1
            template = templates[question % len(templates)]
            prompt = np.concatenate([template, questions[question]])
            trace.append(TraceRequest(prompt, answers[question]))
            continue
        i = int(rng.integers(len(chats)))
        prompt = np.concatenate([chats[i], tokens(20, 300)])
        outputs = [tokens(50, 400) for _ in range(4 if kind > 0.9 else 1)]
        trace.extend(TraceRequest(prompt, out) for out in outputs)
        chats[i] = np.concatenate([prompt, outputs[0]])
        if chats[i].size > MAX_CONTEXT - 700:  # the conversation is full: start a new one
            chats[i] = systems[rng.integers(len(systems))]
    return trace[:num_requests]


@dataclass
class OpTimer:
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, start: float, tokens: int) -> None:
        self.seconds[op] += time.perf_counter() - start
        self.calls[op] += 1
        self.tokens[op] += tokens


@dataclass(eq=False)
class Running:
    ids: np.ndarray  # (len,) prompt + output token ids
    slots: torch.Tensor  # (len,) int64; [0, locked_len) are the tree's, the rest private
    node: TreeNode  # locked
    locked_len: int


class Replay:
    """The scheduler's side of the protocol, with every cache call timed."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.allocator = cache.allocator
        self.timer = OpTimer()
        self.running: deque[Running] = deque()

    def admit(self, request: TraceRequest) -> None:
        match = self.match(request.prompt)
        self.lock(match.node)
        prefill = self.alloc(request.prompt.size - match.length, after=None)
        last = prefill[-1] if prefill.numel() else (match.slots[-1] if match.length else None)
        decode = self.alloc(request.output.size, after=None if last is None else int(last))
        running = Running(
            np.concatenate([request.prompt, request.output]),
            torch.cat([match.slots, prefill, decode]),
            match.node,
            match.length,
        )
        if prefill.numel() > EARLY_INSERT:  # chunked prefill: insert the unfinished request
            self.insert(running, request.prompt.size)
            rematch = self.match(request.prompt)
            running.slots[: rematch.length] = rematch.slots
            self.lock(rematch.node)
            self.unlock(running.node)
            running.node, running.locked_len = rematch.node, rematch.length
        self.running.append(running)
        if len(self.running) > RUNNING:
            self.finish(self.running.popleft())

    def finish(self, request: Running) -> None:
        self.insert(request, request.ids.size)
        aligned = request.ids.size - request.ids.size % self.allocator.page_size
        self.allocator.free(request.slots[aligned:])  # the partial trailing page stays ours
        self.unlock(request.node)

    def alloc(self, n: int, after: int | None) -> torch.Tensor:
        """Allocate n slots (continuing after slot ``after``), evicting under pressure and,
        if everything left is locked, finishing the oldest running requests first."""
        while True:
            if after is None:
                slots = self.allocator.alloc(n)
            else:
                slots = self.allocator.alloc_continuing(after, n)
            if slots is not None:
                return slots
            page_size = self.allocator.page_size
            start = time.perf_counter()
            freed = self.cache.evict(-(-n // page_size) * page_size - self.allocator.available())
            self.timer.add("evict", start, freed)
            if freed == 0:
                if not self.running:
                    raise RuntimeError(f"a {n}-token request does not fit in the pool")
                self.finish(self.running.popleft())

    def match(self, ids: np.ndarray) -> MatchResult:
        start = time.perf_counter()
        match = self.cache.match_prefix(ids)
        self.timer.add("match_prefix", start, ids.size)
        return match

    def insert(self, request: Running, end: int) -> None:
        start = time.perf_counter()
        cached = self.cache.insert(request.ids[:end], request.slots[:end])
        self.timer.add("insert", start, end)
        self.allocator.free(request.slots[request.locked_len : cached])  # our duplicates

    def lock(self, node: TreeNode) -> None:
        start = time.perf_counter()
        self.cache.lock(node)
        self.timer.add("lock", start, 0)

    def unlock(self, node: TreeNode) -> None:
        start = time.perf_counter()
        self.cache.unlock(node)
        self.timer.add("unlock", start, 0)

    def private_slots(self) -> torch.Tensor:
        private = [r.slots[r.locked_len :] for r in self.running]
        return torch.cat([torch.empty(0, dtype=torch.int64), *private])


def run_replay(trace: list[TraceRequest], num_slots: int, page_size: int, policy: str) -> dict:
    cache = RadixCache(KVSlotAllocator(num_slots, page_size), policy=policy)
    replay = Replay(cache)
    wall = time.perf_counter()
    for request in trace:
        replay.admit(request)
    wall = time.perf_counter() - wall
    cache.check_invariants(private_slots=replay.private_slots())  # no slot leaked on the way
    stats = cache.stats()
    ops = {
        op: {
            "calls": replay.timer.calls[op],
            "seconds": replay.timer.seconds[op],
            "ops_per_s": replay.timer.calls[op] / max(replay.timer.seconds[op], 1e-12),
            "tokens_per_s": replay.timer.tokens[op] / max(replay.timer.seconds[op], 1e-12),
            "mean_us": 1e6 * replay.timer.seconds[op] / max(replay.timer.calls[op], 1),
        }
        for op in OPS
    }
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
        "ops": ops,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small trace, for smoke tests")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "radix_cache_bench.json",
        help="where to write the JSON results",
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
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
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

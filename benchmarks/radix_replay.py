"""The radix-cache benchmark's trace and replay: a prefix-sharing request trace, driven through a
cache the way the scheduler drives RadixCache, every cache call timed.

The trace mixes multi-turn chats (system prompt + growing history, up to 8k tokens), few-shot
prompts (long shared examples + a short question) and parallel samples of one prompt. Each
request is matched, locked, given the rest of its slots (evicting under memory pressure), has
its prefill inserted early when long and its lock moved, and at finish inserts prompt + output,
frees duplicates and unlocks.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from radix_cache import KVSlotAllocator, MatchResult

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


class ReplayCache(Protocol):
    """The calls the replay makes: RadixCache's, or SGLang's tree behind them."""

    allocator: KVSlotAllocator

    def match_prefix(self, token_ids: Any) -> MatchResult: ...
    def insert(self, token_ids: Any, slots: torch.Tensor) -> int: ...
    def evict(self, num_tokens: int) -> int: ...
    def lock(self, node: Any) -> None: ...
    def unlock(self, node: Any) -> None: ...


@dataclass(eq=False)
class Running:
    ids: Any  # (len,) prompt + output token ids, in the cache's native form
    slots: torch.Tensor  # (len,) int64; [0, locked_len) are the tree's, the rest private
    node: Any  # locked
    locked_len: int


class Replay:
    """The scheduler's side of the protocol, with every cache call timed. ``native`` turns a
    trace's numpy ids into what the cache takes (untimed, as a scheduler keeps them so)."""

    def __init__(
        self, cache: ReplayCache, native: Callable[[np.ndarray], Any] = lambda ids: ids
    ) -> None:
        self.cache = cache
        self.native = native
        self.allocator = cache.allocator
        self.timer = OpTimer()
        self.running: deque[Running] = deque()
        self.hit_tokens = 0  # matched, over every match

    def admit(self, request: TraceRequest) -> None:
        prompt = self.native(request.prompt)
        match = self.match(prompt)
        self.lock(match.node)
        prefill = self.alloc(request.prompt.size - match.length, after=None)
        last = prefill[-1] if prefill.numel() else (match.slots[-1] if match.length else None)
        decode = self.alloc(request.output.size, after=None if last is None else int(last))
        running = Running(
            self.native(np.concatenate([request.prompt, request.output])),
            torch.cat([match.slots, prefill, decode]),
            match.node,
            match.length,
        )
        if prefill.numel() > EARLY_INSERT:  # chunked prefill: insert the unfinished request
            self.insert(running, request.prompt.size)
            rematch = self.match(prompt)
            running.slots[: rematch.length] = rematch.slots
            self.lock(rematch.node)
            self.unlock(running.node)
            running.node, running.locked_len = rematch.node, rematch.length
        self.running.append(running)
        if len(self.running) > RUNNING:
            self.finish(self.running.popleft())

    def finish(self, request: Running) -> None:
        self.insert(request, len(request.ids))
        aligned = len(request.ids) - len(request.ids) % self.allocator.page_size
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

    def match(self, ids: Any) -> MatchResult:
        start = time.perf_counter()
        match = self.cache.match_prefix(ids)
        self.timer.add("match_prefix", start, len(ids))
        self.hit_tokens += match.length
        return match

    def insert(self, request: Running, end: int) -> None:
        start = time.perf_counter()
        cached = self.cache.insert(request.ids[:end], request.slots[:end])
        self.timer.add("insert", start, end)
        self.allocator.free(request.slots[request.locked_len : cached])  # our duplicates

    def lock(self, node: Any) -> None:
        start = time.perf_counter()
        self.cache.lock(node)
        self.timer.add("lock", start, 0)

    def unlock(self, node: Any) -> None:
        start = time.perf_counter()
        self.cache.unlock(node)
        self.timer.add("unlock", start, 0)

    def private_slots(self) -> torch.Tensor:
        private = [r.slots[r.locked_len :] for r in self.running]
        return torch.cat([torch.empty(0, dtype=torch.int64), *private])


def op_summary(timer: OpTimer) -> dict[str, dict[str, float]]:
    return {
        op: {
            "calls": timer.calls[op],
            "seconds": timer.seconds[op],
            "ops_per_s": timer.calls[op] / max(timer.seconds[op], 1e-12),
            "tokens_per_s": timer.tokens[op] / max(timer.seconds[op], 1e-12),
            "mean_us": 1e6 * timer.seconds[op] / max(timer.calls[op], 1),
        }
        for op in OPS
    }


def replay_all(replay: Replay, trace: list[TraceRequest]) -> float:
    """Admit every request of the trace; wall seconds."""
    wall = time.perf_counter()
    for request in trace:
        replay.admit(request)
    return time.perf_counter() - wall

"""The KV disk tier (``--kv-disk-path``) on SmolLM2: what it saves and what it costs.

Three measurements, each on the built-in SmolLM2-135M-Instruct (Q4_1 GGUF, float32 KV):

- workloads: the agent and multi-turn workloads of ``arbor bench`` with the KV pool at a
  quarter of the working set (the workload's distinct prefix tokens: the tokens of the trie of
  every call's prompt and output, as ``optimal_hit_rate`` builds it), without and with the
  tier: cache hit rate (memory + disk) and output tokens/s;
- restart: time to first token of a ``--prefix-tokens`` prompt (English prose) computed cold,
  then after a restart on the same tier folder, with the chunk files in the page cache and
  with them dropped from it (``posix_fadvise(DONTNEED)`` on each file: dropping the whole page
  cache needs root and would disturb everything else on the machine);
- write path: a batch of ``--batch`` requests decoding while the pool evicts older prefixes
  (write_back hands them to the tier): the scheduler thread's time in the eviction hook per
  decode step, against the step's time.

    python -m benchmarks.kv_tier_bench [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ENGLISH_PASSAGE, print_table, timed_into, write_json
from benchmarks.suite.trace import Call, SystemRun
from benchmarks.suite.workloads.agent import Agent
from benchmarks.suite.workloads.base import Workload
from benchmarks.suite.workloads.multi_turn import MultiTurn
from runtime import Engine
from runtime.model_files import builtin_model_path

# The pool of the sizing run: room for the quick and default workloads' whole working set
# (SmolLM2's float32 K/V: 46 KB a token, 750 MB).
SIZING_POOL_TOKENS = 16384
SECTIONS = ("workloads", "restart", "write-path")
# Agent tasks and multi-turn sessions in --quick: the pool must hold twice the longest call,
# and with the workloads' quick presets (6 each) that floor kept the pool at 38% of the working
# set; 12 make the longest call a small enough share for the pool to be the quarter asked for.
QUICK_COUNT = 12


def distinct_prefix_tokens(calls: Sequence[Call]) -> int:
    """Tokens of the trie of every call's prompt and output: what an unbounded prefix cache
    holds after the workload (the working set)."""
    root: dict[int, Any] = {}
    count = 0
    for call in calls:
        node = root
        for token in (*call.prompt_ids, *call.output_ids):
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def _throughput(run: SystemRun) -> float:
    return sum(len(out) for out in run.outputs) / run.wall_s


def bench_workload(model: str, workload: Workload) -> list[dict[str, Any]]:
    """The workload with an unbounded pool (sizing), then at a quarter of its working set
    without and with the tier, then again with the unbounded pool and no tier: the ceiling,
    what any cache, memory or disk, could give this workload (its hit rate is the workload's
    own limit: every first-seen token is computed)."""
    with Engine(model, max_total_tokens=SIZING_POOL_TOKENS) as engine:
        sizing = workload.run_arbor(engine)
    working_set = distinct_prefix_tokens(sizing.calls)
    longest = max(len(c.prompt_ids) + len(c.output_ids) for c in sizing.calls)
    pool = max(working_set // 4, 2 * longest)
    rows = []
    for tier, pool_tokens in ((False, pool), (True, pool), (None, SIZING_POOL_TOKENS)):
        with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as folder:
            extra = {"kv_disk_path": folder} if tier else {}
            with Engine(model, max_total_tokens=pool_tokens, **extra) as engine:
                run = workload.run_arbor(engine)
                info = engine.get_server_info()
        rows.append(
            {
                "workload": workload.name,
                # None: the ceiling run (unbounded pool, no tier)
                "tier": tier,
                "working_set_tokens": working_set,
                "pool_tokens": pool_tokens,
                "pool_share": pool_tokens / working_set,
                "calls": len(run.calls),
                "cache_hit_rate": run.cache_hit_rate,
                "output_tokens_per_s": _throughput(run),
                "wall_s": run.wall_s,
                "disk_hit_tokens": info["kv_disk_hits_tokens"],
                "disk_writes": info["kv_disk_writes"],
                # Where the time goes besides hits: the prompt tokens computed, and how many
                # tokens each forward step gave (a smaller pool runs fewer requests at once).
                "computed_prompt_tokens": info["prompt_tokens"] - info["cached_tokens"],
                "forward_steps": info["forward_steps"],
                "tokens_per_step": info["generated_tokens"] / max(1, info["forward_steps"]),
            }
        )
    return rows


def _prefix(engine: Engine, tokens: int) -> list[int]:
    ids = engine.tokenizer(ENGLISH_PASSAGE.read_text()).input_ids
    return (ids * (tokens // len(ids) + 1))[:tokens]


def _ttft(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - start


def _drop_from_page_cache(folder: str) -> int:
    """posix_fadvise(DONTNEED) on every file under ``folder``; how many."""
    count = 0
    for path in Path(folder).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def bench_restart(model: str, prefix_tokens: int) -> dict[str, Any]:
    """TTFT of a long cached prefix: cold, then after a restart (page cache warm, dropped)."""
    warm = [10, 11, 12, 13] * 40
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as folder:
        pool = {"max_total_tokens": prefix_tokens + 1024}
        with Engine(model, kv_disk_path=folder, **pool) as engine:
            _ttft(engine, warm)
            prefix = _prefix(engine, prefix_tokens)
            cold = _ttft(engine, prefix + [42])
        # Shutdown saved the prefix's chunks; a new server on the folder serves them.
        with Engine(model, kv_disk_path=folder, **pool) as engine:
            _ttft(engine, warm)
            before = engine.get_server_info()["kv_disk_hits_tokens"]
            page_cache_warm = _ttft(engine, prefix + [43])
            warm_hits = engine.get_server_info()["kv_disk_hits_tokens"] - before
            engine.flush_cache()  # memory only: the tier keeps the chunks
            dropped_files = _drop_from_page_cache(folder)
            before = engine.get_server_info()["kv_disk_hits_tokens"]
            page_cache_dropped = _ttft(engine, prefix + [44])
            dropped_hits = engine.get_server_info()["kv_disk_hits_tokens"] - before
    return {
        "prefix_tokens": prefix_tokens,
        "cold_ttft_s": cold,
        "restart_warm_ttft_s": page_cache_warm,
        "restart_warm_disk_tokens": warm_hits,
        "restart_dropped_ttft_s": page_cache_dropped,
        "restart_dropped_disk_tokens": dropped_hits,
        "files_dropped_from_page_cache": dropped_files,
        "speedup_warm": cold / page_cache_warm,
        "speedup_dropped": cold / page_cache_dropped,
    }


def bench_write_path(model: str, batch: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    """``batch`` requests decoding in a pool that holds them and half as many cached tokens
    again: the cached prefixes of an earlier batch are evicted, and written, as they decode."""
    per_request = prompt_len + output_len
    pool = batch * per_request + batch * prompt_len // 2
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    results = {}
    for tier in (False, True):
        with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as folder:
            extra = {"kv_disk_path": folder} if tier else {}
            with Engine(model, max_total_tokens=pool, max_running_requests=batch, **extra) as eng:
                ids = _prefix(eng, prompt_len * 2 * batch)
                prompts = [ids[i * prompt_len : (i + 1) * prompt_len] for i in range(2 * batch)]
                eng.generate(input_ids=prompts[:batch], sampling_params=params)  # the cache
                hook_seconds = [0.0]
                tree = eng.scheduler.kv.tree
                if tier:
                    assert tree is not None and tree.evict_hook is not None
                    tree.evict_hook = timed_into(tree.evict_hook, hook_seconds)
                before = eng.get_server_info()
                start = time.perf_counter()
                eng.generate(input_ids=prompts[batch:], sampling_params=params)
                wall = time.perf_counter() - start
                after = eng.get_server_info()
        steps = after["forward_steps"] - before["forward_steps"]
        results[tier] = {
            "steps": steps,
            "wall_s": wall,
            "step_ms": 1e3 * wall / steps,
            "hook_ms_per_step": 1e3 * hook_seconds[0] / steps,
            "chunks_written": after["kv_disk_writes"] - before["kv_disk_writes"],
        }
    with_tier = results[True]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "pool_tokens": pool,
        "without_tier": results[False],
        "with_tier": with_tier,
        "hook_share_of_step": with_tier["hook_ms_per_step"] / with_tier["step_ms"],
        "step_time_ratio": with_tier["step_ms"] / results[False]["step_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small workloads and write-path requests"
    )
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--requests",
        type=int,
        help=f"agent tasks and multi-turn sessions (default: {QUICK_COUNT} with --quick, "
        "else the presets')",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        help="run this section (repeatable; default: all three)",
    )
    parser.add_argument("--out", help="the JSON result's path")
    args = parser.parse_args()
    model = builtin_model_path()
    sections = args.only or SECTIONS
    result: dict[str, Any] = {"quick": args.quick}
    if "workloads" in sections:
        result["workloads"] = _workloads(model, args.quick, args.requests)
    if "restart" in sections:
        result["restart"] = _restart(model, args.prefix_tokens)
    if "write-path" in sections:
        result["write_path"] = _write_path(model, args.batch, args.quick)
    write_json("kv_tier_bench", result, args.out)


def _workloads(model: str, quick: bool, requests: int | None) -> list[dict[str, Any]]:
    rows = []
    count = requests or (QUICK_COUNT if quick else None)
    for workload in (Agent.preset(quick), MultiTurn.preset(quick)):
        if count:
            workload = workload.with_count(count)
        rows += bench_workload(model, workload)
    print_table(
        [
            "workload",
            "tier",
            "working set",
            "pool",
            "pool share",
            "hit rate",
            "out tok/s",
            "disk tokens",
            "computed prompt tok",
            "steps",
            "out tok/step",
        ],
        [
            [
                r["workload"],
                {True: "on", False: "off", None: "off (ceiling)"}[r["tier"]],
                r["working_set_tokens"],
                r["pool_tokens"],
                "unbounded" if r["tier"] is None else f"{r['pool_share']:.0%}",
                r["cache_hit_rate"],
                r["output_tokens_per_s"],
                r["disk_hit_tokens"],
                r["computed_prompt_tokens"],
                r["forward_steps"],
                r["tokens_per_step"],
            ]
            for r in rows
        ],
    )
    print()
    return rows


def _restart(model: str, prefix_tokens: int) -> dict[str, Any]:
    restart = bench_restart(model, prefix_tokens)
    print_table(
        ["prefix", "cold TTFT s", "restart, page cache warm", "restart, dropped", "speedups"],
        [
            [
                restart["prefix_tokens"],
                restart["cold_ttft_s"],
                restart["restart_warm_ttft_s"],
                restart["restart_dropped_ttft_s"],
                f"{restart['speedup_warm']:.1f}x / {restart['speedup_dropped']:.1f}x",
            ]
        ],
    )
    print()
    return restart


def _write_path(model: str, batch: int, quick: bool) -> dict[str, Any]:
    prompt_len, output_len = (128, 16) if quick else (256, 64)
    write = bench_write_path(model, batch, prompt_len, output_len)
    print_table(
        ["batch", "step ms (off)", "step ms (on)", "hook ms/step", "hook share", "chunks written"],
        [
            [
                write["batch"],
                write["without_tier"]["step_ms"],
                write["with_tier"]["step_ms"],
                write["with_tier"]["hook_ms_per_step"],
                write["hook_share_of_step"],
                write["with_tier"]["chunks_written"],
            ]
        ],
    )
    return write


if __name__ == "__main__":
    main()

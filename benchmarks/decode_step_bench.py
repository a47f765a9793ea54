"""Decode step time by kernel backend: one model forward of B one-token requests at context L.

For each backend (the torch reference, the native C++ kernels, and the native kernels with
shared-prefix cascade attention), each batch size and context length, times one decode step
of the model runner and the share of it spent in attention. Sequences either own all their
KV (``distinct``) or share the first ``--shared`` fraction of their context (``shared``, a
few-shot header); cascade runs only on shared layouts. K/V hold random values: only speed is
measured here (the kernel tests check values).

    python -m benchmarks.decode_step_bench [--preset small] [--batches 1,32,128]
        [--contexts 128,1024] [--shared 0.75] [--kv-cache-dtype auto|fp32|bf16|fp16] [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import arbor_kernels as kernels
import torch

from benchmarks.common import print_table, timed_into, write_json
from runtime.cascade import DEFAULT_MIN_PREFIX
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.test_model import cached_test_model

ATTENTION_OPS = (
    "decode_attention",
    "decode_self_attention",  # on CPU, with the RoPE and K/V write it fuses
    "decode_attention_with_lse",
    "shared_prefix_attention",
    "merge_attention_states",
)


@contextmanager
def _timed_attention(clock: list[float]) -> Iterator[None]:
    """Accumulate the wall time of every attention op call into clock[0]."""
    originals = {name: getattr(kernels, name) for name in ATTENTION_OPS}

    for name, fn in originals.items():
        setattr(kernels, name, timed_into(fn, clock))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)


def _layout(runner: ModelRunner, batch: int, context: int, shared: int) -> list[int]:
    """Rows of ``batch`` sequences of ``context`` tokens whose first ``shared`` slots coincide;
    K/V of every used slot filled with random values."""
    rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
    assert all(row is not None for row in rows)
    own = context - shared
    for i, row in enumerate(rows):
        assert row is not None
        runner.req_to_token_pool.write(row, 0, torch.arange(shared))
        runner.req_to_token_pool.write(
            row, shared, torch.arange(shared + i * own, shared + (i + 1) * own)
        )
    used = shared + batch * own
    gen = torch.Generator().manual_seed(0)
    for layer in range(runner.kv_pool.num_layers):
        for buffers in (runner.kv_pool.k_buffers, runner.kv_pool.v_buffers):
            shape = buffers[layer][:used].shape
            buffers[layer][:used] = torch.randn(shape, generator=gen).to(buffers[layer].dtype)
    return [row for row in rows if row is not None]


def _step_seconds(
    runner: ModelRunner, rows: list[int], context: int, cascade: bool, repeat: int
) -> tuple[float, float]:
    """(best seconds per decode step, attention seconds within that step)."""
    ids = [[11 + i % 100] for i in range(len(rows))]
    runner.cascade_min_prefix = DEFAULT_MIN_PREFIX if cascade else None

    def step() -> None:
        runner.forward(runner.build_batch(rows, [context - 1] * len(rows), ids))

    step()
    best, attention = float("inf"), 0.0
    for _ in range(repeat):
        clock = [0.0]
        with _timed_attention(clock):
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
        if elapsed < best:
            best, attention = elapsed, clock[0]
    return best, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--shared", type=float, default=0.75)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's dtype")
    parser.add_argument("--quick", action="store_true", help="batches 1,8 and context 128")
    args = parser.parse_args()
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    contexts = [128] if args.quick else [int(c) for c in args.contexts.split(",")]
    model = cached_test_model(args.preset, "llama")
    runner = ModelRunner(RunnerConfig(
        str(model), kv_slots=max(batches) * max(contexts) + 64, max_requests=max(batches),
        context_len=max(contexts) + 8, kv_cache_dtype=args.kv_cache_dtype,
    ))  # fmt: skip
    variants = [("torch", "distinct", False), ("native", "distinct", False)]
    variants += [("torch", "shared", False), ("native", "shared", False)]
    variants += [("native", "shared", True)]
    if not kernels.native_available():
        variants = [v for v in variants if v[0] == "torch"]
    results: list[dict[str, Any]] = []
    for context in contexts:
        for batch in batches:
            for backend, layout, cascade in variants:
                if layout == "shared" and batch == 1:
                    continue
                kernels.set_kernel_backend(backend)
                shared = int(context * args.shared) if layout == "shared" else 0
                rows = _layout(runner, batch, context, shared)
                seconds, attention = _step_seconds(runner, rows, context, cascade, args.repeat)
                for row in rows:
                    runner.req_to_token_pool.free(row)
                results.append({
                    "backend": backend + ("+cascade" if cascade else ""),
                    "layout": layout, "batch": batch, "context": context,
                    "step_ms": round(seconds * 1e3, 2),
                    "ms_per_token": round(seconds * 1e3 / batch, 3),
                    "attention_share": round(attention / seconds, 3),
                })  # fmt: skip
                print(results[-1], flush=True)
    kernels.set_kernel_backend("auto")
    rows_out = [
        [r["backend"], r["layout"], r["batch"], r["context"], r["step_ms"], r["ms_per_token"],
         f"{r['attention_share']:.0%}"]
        for r in results
    ]  # fmt: skip
    print_table(
        ["backend", "layout", "batch", "context", "step ms", "ms/token", "attention"], rows_out
    )
    payload = {"preset": args.preset, "threads": torch.get_num_threads(),
               "kv_cache_dtype": args.kv_cache_dtype, "results": results}  # fmt: skip
    write_json(f"decode_step_bench-kv-{args.kv_cache_dtype}", payload)


if __name__ == "__main__":
    main()

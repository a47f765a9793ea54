"""Window KV memory on Gemma 3 (issue 53): bytes per token at a 4K context, and exactness.

``python -m benchmarks.window_kv_bench [--model-path gemma3-270m] [--context 4096]`` runs
``runtime.Engine`` on the Gemma 3 file three ways, one engine at a time, and prints a table
(written to ``benchmarks/results/window_kv_bench.json``):

- **full-size**: ``--disable-hybrid-swa-memory``, every layer keeps every token (the figure
  llama.cpp's "full-size SWA cache" has);
- **window**: the window layers get a pool just big enough for one window and a prefill
  chunk (``--swa-full-tokens-ratio``), a ``--context``-token request runs in it;
- **shared prefix**: two requests sharing a 2,000-token prefix, at the default ratio; the
  second's cached tokens, and its output against a run with the radix cache off; then the
  same under a window pool so small that the first request's later chunks evict the prefix's
  window: the match stops where the window is whole, the output stays equal.

Bytes per token are the pool's K/V bytes over its full slots (``kv_bytes_per_token`` of
``server_info``); the 4K request's greedy output must equal the full-size run's (both prefill
in the same chunks). The text is the project's docs, tokenized by the model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_description, print_table, write_json
from runtime import Engine

DOCS = Path(__file__).resolve().parent.parent / "docs"
CHUNK = 256  # every run prefills in chunks this size, so outputs are comparable bit for bit
SHARED_PREFIX = 2000


def document_ids(engine: Engine, count: int) -> list[int]:
    """``count`` token ids of the project's docs (real English and code)."""
    text = "\n\n".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    ids = engine.tokenizer.encode(text)
    if len(ids) < count:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {count}")
    return list(ids[:count])


def run(engine: Engine, ids: list[int], new_tokens: int) -> tuple[dict[str, Any], float]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)
    return out, time.perf_counter() - start


def context_row(
    name: str, model: str, context: int, new_tokens: int, **engine_args: Any
) -> tuple[list[Any], list[int]]:
    with Engine(model, max_total_tokens=context + 256, chunked_prefill_size=CHUNK,
                **engine_args) as engine:  # fmt: skip
        ids = document_ids(engine, context - new_tokens)
        out, seconds = run(engine, ids, new_tokens)
        info = engine.get_server_info()
    per_token = info["kv_bytes_per_token"]
    row = [
        name, context, info["kv_window_slots"], info["kv_window_peak_tokens"], per_token,
        seconds,
    ]  # fmt: skip
    return row, out["output_ids"]


def shared_prefix_row(name: str, model: str, new_tokens: int, **engine_args: Any) -> dict[str, Any]:
    with Engine(model, max_total_tokens=8192, chunked_prefill_size=CHUNK,
                **engine_args) as engine:  # fmt: skip
        ids = document_ids(engine, SHARED_PREFIX + 200)
        prefix = ids[:SHARED_PREFIX]
        first, second = prefix + ids[SHARED_PREFIX : SHARED_PREFIX + 100], prefix + ids[-60:]
        run(engine, first, new_tokens)
        shared, _ = run(engine, second, new_tokens)
        info = engine.get_server_info()
    with Engine(model, max_total_tokens=8192, chunked_prefill_size=CHUNK,
                disable_radix_cache=True, **engine_args) as engine:  # fmt: skip
        alone, _ = run(engine, second, new_tokens)
    return {
        "run": name,
        "window_slots": info["kv_window_slots"],
        "cached_tokens": shared["meta_info"]["cached_tokens"],
        "equal_to_no_cache": shared["output_ids"] == alone["output_ids"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="gemma3-270m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cpu = cpu_description()
    # The window pool of the "window" run: one window, one chunk, two pages of slack.
    with Engine(args.model_path, max_total_tokens=256) as probe:
        window = max(probe.scheduler.runner.config.layer_windows or (0,))
    if not window:
        raise SystemExit(f"{args.model_path} has no sliding-window layers")
    full_slots = args.context + 256
    ratio = (window + CHUNK + 8) / full_slots
    full, full_ids = context_row(
        "full-size", args.model_path, args.context, args.new_tokens,
        disable_hybrid_swa_memory=True,
    )  # fmt: skip
    windowed, window_ids = context_row(
        "window", args.model_path, args.context, args.new_tokens, swa_full_tokens_ratio=ratio
    )
    share = full[4] and windowed[4] / full[4]
    headers = ["run", "context", "window slots", "peak window used", "KV B/token", "seconds"]
    print(f"\n{args.model_path} on {cpu}; prefill chunks of {CHUNK}\n")
    print_table(headers, [full, windowed])
    print(
        f"\nwindow run: {share:.1%} of the full-size bytes per token; greedy output "
        f"{'equal' if full_ids == window_ids else 'DIFFERENT'} over {args.new_tokens} tokens"
    )
    shared = [
        shared_prefix_row("default ratio", args.model_path, 16),
        shared_prefix_row(
            "tight window pool", args.model_path, 16, swa_full_tokens_ratio=(window + 80) / 8192
        ),
    ]  # fmt: skip
    print(f"\nA {SHARED_PREFIX}-token prefix shared by two requests\n")
    print_table(list(shared[0]), [list(row.values()) for row in shared])
    write_json("window_kv_bench", {
        "cpu": cpu,
        "model": args.model_path,
        "chunk": CHUNK,
        "context_runs": [dict(zip(headers, row, strict=True)) for row in (full, windowed)],
        "bytes_share": share,
        "greedy_equal": full_ids == window_ids,
        "shared_prefix": shared,
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()

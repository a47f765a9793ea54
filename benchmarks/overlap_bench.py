"""Step time with and without the overlap scheduler, and what a JSON schema adds to a step.

Through ``runtime.Engine`` on the ``small`` test model with a 151,936-token vocabulary (built
on first use, about 2 minutes), greedy, fixed output lengths. For each case and each mode
(overlap on, ``disable_overlap_schedule=True``), the wall time per forward step, best of
``--repeat`` runs, the two engines taking turns so that drift on a shared machine hits both:

- unconstrained decoding at batch 1 and 32 (the scheduler's own CPU work per step);
- JSON-schema decoding at batch 16 — a schema of fixed keys, enums, an integer and a boolean
  (``long_fixed_keys``) and one with free-text strings — against unconstrained decoding of the
  same output lengths at the same batch: the constrained step's extra cost in percent
  (issue target: at most 5%). Jump-forward is off throughout (see ``main``).

    python -m benchmarks.overlap_bench [--repeat 3] [--quick] [--max-total-tokens N]
        [--json-format aligned|compact] [--cases unconstrained,long_fixed_keys,free_text]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import print_table, write_json
from benchmarks.grammar_bench import LONG_KEYS, VOCAB
from runtime import Engine
from runtime.test_model import cached_test_model

# grammar_bench's free-text schema with its summary bounded too (both strings then take the
# slow bounded-repetition masks).
FREE_TEXT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "summary": {"type": "string", "maxLength": 200},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "summary", "rating"],
}


CASES = ("unconstrained", "long_fixed_keys", "free_text")


def _prompts(batch: int) -> list[str]:
    return [f"Reply in JSON ({i}):" for i in range(batch)]


def _run(engine: Engine, prompts: list[str], params: list[dict[str, Any]]) -> dict[str, float]:
    """One timed generate: wall seconds, forward steps, output tokens."""
    before = engine.get_server_info()["forward_steps"]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps = engine.get_server_info()["forward_steps"] - before
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"seconds": seconds, "steps": steps, "tokens": tokens}


def _best(
    engines: dict[str, Engine], prompts: list[str], params: list[dict[str, Any]], repeat: int
) -> dict[str, dict[str, float]]:
    """Per mode, the run with the least wall time per step (after one warm-up run each)."""
    for engine in engines.values():
        _run(engine, prompts, params)
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeat):
        for mode, engine in engines.items():
            run = _run(engine, prompts, params)
            run["ms_per_step"] = run["seconds"] / max(run["steps"], 1) * 1e3
            if mode not in best or run["ms_per_step"] < best[mode]["ms_per_step"]:
                best[mode] = run
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter outputs, one repeat")
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool of each engine (default: 30%% of memory each; a shared machine may need "
        "less: 16384 holds every case)",
    )
    parser.add_argument(
        "--json-format",
        choices=("aligned", "compact"),
        default=None,
        help="the JSON rows' layout (default: the runtime's, aligned)",
    )
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated cases to run (default: all of {', '.join(CASES)})",
    )
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; expected some of {', '.join(CASES)}")
    repeat = 1 if args.quick else args.repeat
    new_tokens = 24 if args.quick else 64
    path = cached_test_model("small", "llama", vocab_size=VOCAB)
    # Jump-forward off: its drafts make constrained steps longer but fewer, which is not the
    # per-step cost of the mask measured here (grammar_bench measures jump-forward).
    pool = {"max_total_tokens": args.max_total_tokens}
    engines = {
        "overlap": Engine(path, disable_jump_forward=True, **pool),
        "plain": Engine(path, disable_jump_forward=True, disable_overlap_schedule=True, **pool),
    }
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    try:
        for batch in (1, 32) if "unconstrained" in cases else ():
            free = [{"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}] * batch
            best = _best(engines, _prompts(batch), free, repeat)
            on, off = best["overlap"]["ms_per_step"], best["plain"]["ms_per_step"]
            rows.append(["unconstrained", batch, off, on, (1 - on / off) * 100, "", ""])
            results.append({"case": "unconstrained", "batch": batch, **_flat(best)})
        for name, schema in (("long_fixed_keys", LONG_KEYS), ("free_text", FREE_TEXT)):
            if name not in cases:
                continue
            batch = 16
            constrained = [{"json_schema": schema, "max_new_tokens": 160, "temperature": 0}]
            if args.json_format is not None:
                constrained[0]["json_format"] = args.json_format
            best = _best(engines, _prompts(batch), constrained * batch, repeat)
            # Unconstrained decoding of the same lengths, so both runs do the same steps.
            lengths = [
                o["meta_info"]["completion_tokens"]
                for o in engines["plain"].generate(_prompts(batch), constrained * batch)
            ]
            free = [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in lengths]
            base = _best(engines, _prompts(batch), free, repeat)
            extra = {
                mode: (best[mode]["ms_per_step"] / base[mode]["ms_per_step"] - 1) * 100
                for mode in best
            }
            rows.append(
                [
                    f"json {name}",
                    batch,
                    best["plain"]["ms_per_step"],
                    best["overlap"]["ms_per_step"],
                    (1 - best["overlap"]["ms_per_step"] / best["plain"]["ms_per_step"]) * 100,
                    extra["plain"],
                    extra["overlap"],
                ]
            )
            results.append(
                {
                    "case": f"json {name}",
                    "batch": batch,
                    **_flat(best),
                    "unconstrained": _flat(base),
                    "extra_pct_plain": extra["plain"],
                    "extra_pct_overlap": extra["overlap"],
                }
            )
    finally:
        for engine in engines.values():
            engine.shutdown()
    headers = [
        "case",
        "batch",
        "plain ms/step",
        "overlap ms/step",
        "saved %",
        "json extra % (plain)",
        "json extra % (overlap)",
    ]
    print_table(headers, rows)
    write_json("overlap_bench", {"vocab": VOCAB, "results": results}, args.out)


def _flat(best: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {f"{mode}_{key}": value for mode, run in best.items() for key, value in run.items()}


if __name__ == "__main__":
    main()

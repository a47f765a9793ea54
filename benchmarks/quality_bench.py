"""Quality of structured output: does a constraint keep the model's accuracy?

Runs the frozen task sets of ``benchmarks/data/quality`` (``benchmarks/quality_tasks.py``)
through every way Arbor constrains output, on one ``arbor serve`` (127.0.0.1, a free port,
stopped at the end), greedy, and scores each (task, mode):

- **valid**: the output parses and matches the task's schema (``json_object``: is an object;
  ``unconstrained``: the first JSON object in the text, the one label it names, or the call
  the server parsed, else a call in a reply envelope or written as JSON in the text; the
  ``no_call`` task: whether the reply called, right when it did not);
- **items right**, **fields right**: the answer's fields, compared after normalization;
- **out tok**: mean output tokens; **cut**: items ``max_tokens`` cut (there should be none);
- **errors**: items the server refused (e.g. ``json_format`` on a server without it).

Modes (``benchmarks/quality_modes.py``): unconstrained; native ``json_schema`` and OpenAI
``response_format`` json_schema / json_object, each with ``json_format`` aligned and compact;
tool calls with ``tool_choice`` auto and required (aligned, compact); classification with
the native ``choice``, the DSL's ``select`` and an enum schema; the DSL's ``gen(json_schema)``.
Targets (issue 37): 100% valid in every constrained mode; constrained items right >=
unconstrained - 1 on every task; >= 90% right on ``tool_weather``.

    python -m benchmarks.quality_bench [--model-path M] [--tasks a,b] [--modes substr,...]
                                       [--limit N] [--max-tokens 256] [--concurrency 64]
                                       [--sampling '{"dry_multiplier": 0.8}']
    arbor bench quality ...   (the same)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import time
from typing import Any

import httpx

import frontend_lang as fl
from benchmarks.common import print_table, write_json
from benchmarks.quality_modes import Client, Generation, Mode, Refused, all_modes
from benchmarks.quality_tasks import Task, fields_right, is_valid, load_tasks
from runtime.model_files import builtin_model_path, load_tokenizer
from runtime.server import ServerProcess

EXAMPLES_KEPT = 3  # wrong or invalid outputs kept per row in the JSON, to see how it fails


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arbor bench quality", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--model-path", help="GGUF file or HF folder (default: built-in model)")
    parser.add_argument("--tasks", help="comma-separated task names (default: all)")
    parser.add_argument("--modes", help="comma-separated substrings of mode names to run")
    parser.add_argument("--limit", type=int, help="first N items per task (a quick look)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per request")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--max-total-tokens", type=int, default=32768, help="server KV tokens")
    parser.add_argument(
        "--sampling",
        type=_sampling_fields,
        default={},
        help="extra sampling fields for every mode, as a JSON object: '{\"dry_multiplier\": 0.8}'",
    )
    parser.add_argument("--url", help="an arbor serve already running (not started here)")
    parser.add_argument("--out", help="result JSON (default benchmarks/results/quality_bench.json)")
    return parser


def _sampling_fields(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--sampling must be a JSON object")
    return value


def score(
    task: Task, generations: list[Generation | BaseException], schema_bound: bool = True
) -> dict[str, Any]:
    """One row: counts over the items of ``task`` (in order) and the mode's outputs. Valid
    means: matches the task's schema, or (not ``schema_bound``) is a JSON object."""
    schema = task.output_schema if schema_bound else None
    valid = right = fields = cut = errors = 0
    tokens: list[int] = []
    notes: set[str] = set()
    examples: list[dict[str, Any]] = []
    first_error = cut_example = ""
    by_field = dict.fromkeys(task.items[0].answer, 0)
    for item, generation in zip(task.items, generations, strict=True):
        if isinstance(generation, BaseException):
            errors += 1
            first_error = first_error or f"{type(generation).__name__}: {generation}"
            continue
        value = {task.field: generation.value} if task.kind == "label" else generation.value
        ok = is_valid(generation.value, schema)
        got = fields_right(value, item.answer)
        for key, expected in item.answer.items():
            by_field[key] += fields_right(value, {key: expected})
        valid += ok
        fields += got
        right += got == len(item.answer)
        cut += generation.cut
        if generation.cut and not cut_example:
            cut_example = f"{item.id}: ...{generation.text[-200:]}"
        if generation.output_tokens is not None:
            tokens.append(generation.output_tokens)
        if generation.note:
            notes.add(generation.note)
        if (not ok or got < len(item.answer)) and len(examples) < EXAMPLES_KEPT:
            examples.append({"id": item.id, "output": generation.text[:300]})
    return {
        "items": len(task.items),
        "valid": valid,
        "items_right": right,
        "fields_right": fields,
        "fields": sum(len(item.answer) for item in task.items),
        "right_by_field": by_field,
        "mean_output_tokens": statistics.fmean(tokens) if tokens else None,
        "cut": cut,
        "cut_example": cut_example,
        "errors": errors,
        "first_error": first_error,
        "notes": sorted(notes),
        "wrong_examples": examples,
    }


async def run_task(client: Client, task: Task, modes: list[Mode], concurrency: int) -> dict:
    """Every mode on every item of ``task``, ``concurrency`` requests at a time (all modes
    interleaved, so the server batches them)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(mode: Mode, index: int) -> Generation:
        async with gate:
            return await mode.run(client, task, task.items[index])

    jobs = [[one(mode, i) for i in range(len(task.items))] for mode in modes]
    flat = await asyncio.gather(*(job for row in jobs for job in row), return_exceptions=True)
    rows: dict[str, Any] = {}
    for m, mode in enumerate(modes):
        outcomes = flat[m * len(task.items) : (m + 1) * len(task.items)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, Refused | httpx.HTTPError
            ):
                raise outcome  # a bug in the bench, not an answer
        row = score(task, list(outcomes), mode.schema_bound)
        rows[mode.name] = {"constrained": mode.constrained, **row}
    return rows


def check_targets(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's quality targets that a run misses, one line each (empty: all met)."""
    missed = []
    for task, rows in results.items():
        baseline = rows.get("unconstrained")
        for mode, row in rows.items():
            if not row["constrained"] or row["errors"] == row["items"]:
                continue
            if row["valid"] < row["items"]:
                missed.append(f"{task} / {mode}: {row['valid']}/{row['items']} valid")
            if baseline and row["items_right"] < baseline["items_right"] - 1:
                missed.append(
                    f"{task} / {mode}: {row['items_right']} right < unconstrained "
                    f"{baseline['items_right']} - 1"
                )
            if task == "tool_weather" and row["items_right"] < 0.9 * row["items"]:
                missed.append(f"{task} / {mode}: {row['items_right']}/{row['items']} < 90%")
    return missed


def table_rows(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for task, modes in results.items():
        for mode, row in modes.items():
            tokens = row["mean_output_tokens"]
            note = row["first_error"][:70] if row["errors"] else "; ".join(row["notes"])[:70]
            rows.append([
                task, mode, f"{row['valid']}/{row['items']}",
                f"{row['items_right']}/{row['items']}", f"{row['fields_right']}/{row['fields']}",
                "-" if tokens is None else f"{tokens:.1f}", row["cut"], row["errors"], note,
            ])  # fmt: skip
    return rows


async def run_all(args: argparse.Namespace, url: str, model_path: str) -> dict[str, Any]:
    tasks = load_tasks(args.tasks.split(",") if args.tasks else None)
    if args.limit:
        tasks = [Task(**{**t.__dict__, "items": t.items[: args.limit]}) for t in tasks]
    wanted = args.modes.split(",") if args.modes else None
    modes = [m for m in all_modes() if not wanted or any(w in m.name for w in wanted)]
    tokenizer = load_tokenizer(model_path)

    def render_chat(message: str) -> str:
        messages = [{"role": "user", "content": message}]
        return str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )

    loop = asyncio.get_running_loop()  # DSL programs run on threads, as many as requests
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(args.concurrency))
    timeout = httpx.Timeout(900.0, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        client = Client(
            http, model, render_chat, fl.RuntimeEndpoint(url), args.max_tokens, args.sampling
        )
        results = {}
        for task in tasks:
            start = time.perf_counter()
            kinds_modes = [m for m in modes if task.kind in m.kinds]
            results[task.name] = await run_task(client, task, kinds_modes, args.concurrency)
            print(f"{task.name}: {len(kinds_modes)} modes in {time.perf_counter() - start:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_path = args.model_path or builtin_model_path()
    load_before = os.getloadavg()
    start = time.perf_counter()
    if args.url:
        results = asyncio.run(run_all(args, args.url, model_path))
    else:
        flags = ("--max-total-tokens", str(args.max_total_tokens))
        with ServerProcess(model_path, *flags, startup_timeout_s=600.0) as server:
            results = asyncio.run(run_all(args, server.url, model_path))
    wall = time.perf_counter() - start
    extra = f", sampling {json.dumps(args.sampling)}" if args.sampling else ""
    print(
        f"\nquality on {model_path} (greedy, max_tokens {args.max_tokens}{extra}), {wall:.0f} s\n"
    )
    headers = [
        "task",
        "mode",
        "valid",
        "items right",
        "fields right",
        "out tok",
        "cut",
        "errors",
        "note",
    ]
    print_table(headers, table_rows(results))
    missed = check_targets(results)
    print("\ntargets: " + ("all met" if not missed else f"{len(missed)} missed"))
    for line in missed:
        print(f"  {line}")
    payload = {
        "command": ["quality_bench", *(argv if argv is not None else sys.argv[1:])],
        "model_path": model_path,
        "max_tokens": args.max_tokens,
        "sampling": args.sampling,
        "limit": args.limit,
        "wall_s": wall,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "results": results,
        "targets_missed": missed,
    }
    write_json("quality_bench", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tuning the aligned JSON layout's bounds on a real model (issue 37's extraction experiment).

30 extraction prompts of our own (``benchmarks/data/json_format_tuning.jsonl``: tuning data,
not the frozen quality-bench sets), greedy, on the built-in SmolLM2-135M-Instruct by default:
"Extract name, age, city and job as JSON. Text: ..." through the chat template, as the OpenAI
chat API renders it. Each mode reports outputs that parse, fields right (of 4 per item), mean
output tokens, mean tokens of the JSON text alone (the free answer's first object; the whole
output otherwise), and the finish reasons::

    python -m benchmarks.json_format_tuning [--model-path P] [--max-tokens 256] [--modes ...]

Modes: ``free`` (no constraint; the first JSON object in the text is parsed), ``compact``,
``runs2`` (``grammar_max_whitespace: 2``), ``aligned`` (the default layout), ``alignedK``
(the aligned layout with at most K indentation characters after a newline), ``spaced`` (the
aligned layout without newlines: ", " and ": " only), and each with ``_object`` for
``json_object`` instead of the schema.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "json_format_tuning.jsonl"
FIELDS = ("name", "age", "city", "job")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "job": {"type": "string"},
    },
    "required": list(FIELDS),
}
DEFAULT_MODES = (
    "free",
    "compact",
    "runs2",
    "spaced",
    "aligned0",
    "aligned2",
    "aligned4",
    "aligned8",
    "aligned",
    "compact_object",
    "aligned_object",
)


def prompt_text(text: str) -> str:
    return f"Extract name, age, city and job as JSON. Text: {text}"


def mode_params(mode: str) -> dict[str, Any]:
    """The sampling params of ``mode`` (besides temperature and max_new_tokens)."""
    from grammar.json_grammar import json_schema_ebnf
    from grammar.json_layout import aligned_rules

    obj = mode.endswith("_object")
    base = mode.removesuffix("_object")
    schema = {"type": "object"} if obj else SCHEMA
    constraint: dict[str, Any] = {"json_object": True} if obj else {"json_schema": SCHEMA}
    if base == "free":
        return {}
    if base in ("compact", "aligned"):
        return constraint | {"json_format": base}
    if base.startswith("runs"):
        return constraint | {"grammar_max_whitespace": int(base[4:])}
    default_ws = aligned_rules()[0]
    ebnf = json_schema_ebnf(schema, False, "aligned")
    if base == "spaced":
        return {"ebnf": ebnf.replace(default_ws, 'arbor_json_ws ::= "" | " "')}
    match = re.fullmatch(r"aligned(\d+)", base)
    if match is None:
        raise ValueError(f"unknown mode {mode!r}")
    return {"ebnf": ebnf.replace(default_ws, aligned_rules(int(match.group(1)))[0])}


def first_object(text: str) -> tuple[Any, str]:
    """The first JSON object in ``text`` (a model's free answer may wrap it in prose or a code
    fence) and its text, or (None, "")."""
    decoder = json.JSONDecoder()
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        try:
            value, end = decoder.raw_decode(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value, text[start : start + end]
    return None, ""


def fields_right(value: Any, item: dict[str, Any]) -> int:
    if not isinstance(value, dict):
        return 0
    right = 0
    for name in FIELDS:
        got, want = value.get(name), item[name]
        if isinstance(want, int):
            right += str(got).strip() == str(want)
        else:
            right += isinstance(got, str) and got.strip().lower() == want.lower()
    return right


def run_mode(engine: Any, prompts: list[str], items: list[dict[str, Any]], mode: str,
             max_tokens: int) -> dict[str, Any]:  # fmt: skip
    params = {"temperature": 0, "max_new_tokens": max_tokens} | mode_params(mode)
    results = engine.generate(prompts, [params] * len(prompts))
    parsed = right = tokens = json_tokens = 0
    finishes: Counter[str] = Counter()
    for result, item in zip(results, items, strict=True):
        text = result["text"]
        value, span = first_object(text) if mode == "free" else (_loads(text), text)
        parsed += value is not None
        right += fields_right(value, item)
        tokens += result["meta_info"]["completion_tokens"]
        json_tokens += len(engine.tokenizer(span, add_special_tokens=False).input_ids)
        finishes[result["meta_info"]["finish_reason"]["type"]] += 1
    return {
        "mode": mode,
        "parse": parsed,
        "fields": right,
        "mean_tokens": tokens / len(items),
        "mean_json_tokens": json_tokens / len(items),
        "finish": dict(finishes),
        "outputs": [r["text"] for r in results],
    }


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--modes", nargs="*", default=list(DEFAULT_MODES))
    parser.add_argument("--dump", type=Path, default=None, help="write every output here")
    args = parser.parse_args()

    import runtime

    items = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    engine = runtime.Engine(args.model_path, max_total_tokens=16384)
    try:
        tokenizer = engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt_text(item["text"])}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for item in items
        ]
        rows = []
        print("| mode | parse | fields right | mean output tokens | mean JSON tokens | finish |")
        print("|---|---|---|---|---|---|")
        for mode in args.modes:
            row = run_mode(engine, prompts, items, mode, args.max_tokens)
            rows.append(row)
            print(
                f"| {mode} | {row['parse']}/{len(items)} | {row['fields']}/{4 * len(items)} "
                f"| {row['mean_tokens']:.1f} | {row['mean_json_tokens']:.1f} | {row['finish']} |",
                flush=True,
            )
        if args.dump is not None:
            args.dump.write_text(json.dumps(rows, indent=1))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

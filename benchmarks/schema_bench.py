"""JSON-schema coverage on real-world schemas: compiled, refused (by keyword), compile time,
and whether generated outputs validate.

The corpus is assembled at run time from schemas that installed packages ship (nothing is
copied into this repository):

- ``check-jsonschema`` (``pip install check-jsonschema``; optional): its vendored SchemaStore
  schemas (GitHub workflows and actions, GitLab CI, Azure Pipelines, Renovate, Dependabot,
  docker compose, CircleCI, Travis, ReadTheDocs, Taskfile, CITATION.cff...; each file's
  licence is in the package's ``builtin_schemas/vendor/licenses``);
- ``jsonschema-specifications`` (a dependency of ``jsonschema``): the JSON Schema
  metaschemas of drafts 3 to 2020-12.

Each file gives one sample for the whole schema and one per definition (``definitions`` /
``$defs``, referenced from a root that keeps every definition), as real requests often use a
part of a big schema. Samples are taken round-robin over the files up to ``--limit``.

Every sample goes through the same preparation as a served request (``CompileSandbox``:
checks, lowering, trial compile, deadline ``--timeout``) with the tiny test model's tokenizer.
For compiled ones, ``--samples`` outputs are generated with the tiny model at temperature 1
(a closing-token bias helps a random model finish; the grammar alone decides validity) and
validated with ``jsonschema`` (formats asserted). The first column is the contract: invalid
finished outputs, which must be 0 (issue 35); ``backend`` counts refusals that show the grammar
backend's words instead of ours (also 0). Targets (issue 16): at least 90% compiled, compile
p90 at most 100 ms.

    python -m benchmarks.schema_bench [--limit 400] [--timeout 10] [--samples 2]
"""

from __future__ import annotations

import argparse
import collections
import importlib.resources
import importlib.util
import json
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_json
from grammar import CompileSandbox, GrammarError, UnsupportedSchemaFeature
from grammar.schema_walk import is_old_draft

Sample = tuple[str, dict[str, Any]]
_REFUSED = re.compile(r"unsupported JSON schema feature '([^']+)'")
# A refusal that shows the grammar backend's own words (or that it refused at all), which no
# refusal should: the checks refuse first, in ours.
_BACKEND_TEXT = re.compile(
    r"cannot compile JSON schema: |cannot compile the constraint: |\.cc:\d+|Cannot find field"
    r"|see the server log"
)


def corpus(limit: int) -> list[Sample]:
    """Up to ``limit`` (name, schema) samples, round-robin over the source files."""
    files = list(_schema_files())
    streams = [_samples(name, schema) for name, schema in files]
    out: list[Sample] = []
    while streams and len(out) < limit:
        for stream in list(streams):
            sample = next(stream, None)
            if sample is None:
                streams.remove(stream)
            elif len(out) < limit:
                out.append(sample)
    return out


def _schema_files() -> Iterator[tuple[str, dict[str, Any]]]:
    # Located without importing check_jsonschema (it needs its own dependencies to import).
    spec = importlib.util.find_spec("check_jsonschema")
    if spec is not None and spec.origin is not None:
        vendor = Path(spec.origin).parent / "builtin_schemas" / "vendor"
        for entry in sorted(vendor.glob("*.json")):
            yield entry.stem, json.loads(entry.read_text())
    metaschemas = Path(str(importlib.resources.files("jsonschema_specifications") / "schemas"))
    for path in sorted(metaschemas.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            try:
                schema = json.loads(path.read_text())
            except ValueError:
                continue
            if isinstance(schema, dict):
                yield f"metaschema-{path.relative_to(metaschemas)}", schema


def _samples(name: str, schema: dict[str, Any]) -> Iterator[Sample]:
    yield name, schema
    # Drafts 4 to 7 ignore a $ref's siblings, so there the whole root can stay (definitions
    # may point at any part of it); later drafts would apply them, so only definitions stay.
    old_draft = is_old_draft(schema)
    for key in ("definitions", "$defs"):
        defs = schema.get(key)
        if isinstance(defs, dict):
            for part in defs:
                kept = {k: v for k, v in schema.items() if old_draft or k in ("$schema", key)}
                kept.pop("$ref", None)
                yield f"{name}#{part}", {**kept, "$ref": f"#/{key}/{_escape(part)}"}


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def prepare_all(
    samples: list[Sample], tokenizer: Any, vocab: int, stop_ids: list[int], timeout: float
) -> list[dict[str, Any]]:
    """Each sample through the request path's preparation, one at a time (so times are its
    own): outcome, refused keyword or message, wall milliseconds, and the prepared result.
    A refused sample is prepared again as ``strict_mode: "validate"`` does (the enforceable
    part, best effort); if that compiles its outcome is "validate"."""
    sandbox = CompileSandbox(("xgrammar", tokenizer, vocab, stop_ids), workers=1, timeout=timeout)
    sandbox.submit({"regex": "warm"}).result()  # the worker's start is not a compile
    results = []
    try:
        for name, schema in samples:
            start = time.perf_counter()
            row: dict[str, Any] = {"name": name}
            try:
                row["prepared"] = sandbox.submit({"json_schema": json.dumps(schema)}).result()
                row["outcome"] = "compiled"
            except UnsupportedSchemaFeature as exc:
                row.update(outcome="refused", keyword=exc.keyword)
            except GrammarError as exc:  # the sandbox sends errors back as GrammarError
                refused = _REFUSED.match(str(exc))
                if refused:
                    row.update(outcome="refused", keyword=refused.group(1))
                else:
                    row.update(outcome="error", message=_bucket(str(exc)))
                row["backend"] = bool(_BACKEND_TEXT.search(str(exc)))
            row["ms"] = (time.perf_counter() - start) * 1e3
            if row["outcome"] == "refused":
                relaxed = {"json_schema": json.dumps(schema), "grammar_best_effort": True}
                try:
                    row["prepared"] = sandbox.submit(relaxed).result()
                    row["outcome"] = "validate"
                except GrammarError:
                    pass
            results.append(row)
    finally:
        sandbox.shutdown()
    return results


def _bucket(message: str) -> str:
    """An error message without its instance details, to count alike errors together."""
    head = message.split(":")[0] if "timed out" not in message else "compile timed out"
    return head[:80]


def generate_and_validate(
    results: list[dict[str, Any]], samples: list[Sample], count: int, attempts: int
) -> collections.Counter[str]:
    """Outputs of the compiled samples, validated against their schemas; for the "validate"
    samples, validate-and-retry as the runtime does it: up to ``attempts`` outputs each, the
    first finished one that validates returned (``retry_*`` counts)."""
    from grammar import create_backend, output_validator
    from runtime.model_config import ModelConfig
    from runtime.model_files import load_tokenizer
    from runtime.model_runner import ModelRunner, RunnerConfig
    from runtime.test_model import cached_test_model
    from tests.grammar.decoder import ConstrainedDecoder

    path = cached_test_model("tiny", "llama")
    config = ModelConfig.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    backend = create_backend("xgrammar", tokenizer, config.vocab_size, config.eos_token_ids)
    runner = ModelRunner(RunnerConfig(str(path), kv_slots=16384, max_requests=16, context_len=1024))
    decoder = ConstrainedDecoder(runner, tokenizer, backend)
    schemas = dict(samples)
    tally: collections.Counter[str] = collections.Counter()
    for row in results:
        if row["outcome"] == "validate" and row["prepared"].lowered is not None:
            compiled = backend.compile_lowered(row["prepared"].lowered)
            check = output_validator(schemas[row["name"]])
            for sample in range(count):
                seeds = [sample * attempts + a for a in range(attempts)]
                outputs = decoder.generate([compiled] * attempts, seeds, 160, 1.0, 4.0)
                try:
                    verdicts = [r.terminated and check(r.text) is None for r in outputs]
                except ValueError:  # the validator cannot evaluate this schema
                    tally["retry_unchecked"] += 1
                    continue
                for attempt, ok in enumerate(verdicts, 1):
                    if ok:
                        tally["retry_valid"] += 1
                        tally["retry_attempts"] += attempt
                        break
                else:
                    tally["retry_exhausted"] += 1
            continue
        if row["outcome"] != "compiled" or row["prepared"].lowered is None:
            continue
        compiled = backend.compile_lowered(row["prepared"].lowered)
        check = output_validator(schemas[row["name"]])
        seeds = list(range(count))
        for result in decoder.generate([compiled] * count, seeds, 160, 1.0, 4.0):
            if not result.terminated:
                tally["unfinished"] += 1
                continue
            try:
                failure = check(result.text)
            except ValueError:  # the validator cannot evaluate this schema
                tally["unchecked"] += 1
                continue
            if failure is None:
                tally["valid"] += 1
            else:
                tally["invalid"] += 1
                row.setdefault("invalid", []).append(f"{result.text[:120]!r}: {failure}"[:300])
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=10.0, help="compile deadline, s")
    parser.add_argument("--samples", type=int, default=2, help="outputs per compiled schema")
    parser.add_argument(
        "--attempts", type=int, default=3, help="validate-and-retry: outputs drawn per sample"
    )
    parser.add_argument("--out", default=None, help="JSON results path")
    args = parser.parse_args()
    from runtime.model_config import ModelConfig
    from runtime.model_files import load_tokenizer
    from runtime.test_model import cached_test_model

    path = cached_test_model("tiny", "llama")
    tokenizer = load_tokenizer(path)
    config = ModelConfig.from_pretrained(path)
    samples = corpus(args.limit)
    sources = len({name.split("#")[0] for name, _ in samples})
    print(f"corpus: {len(samples)} samples from {sources} files")
    results = prepare_all(
        samples, tokenizer, config.vocab_size, list(config.eos_token_ids), args.timeout
    )
    outcomes = collections.Counter(row["outcome"] for row in results)
    keywords = collections.Counter(
        row["keyword"] for row in results if "keyword" in row and row["outcome"] == "refused"
    )
    relaxed = collections.Counter(row["keyword"] for row in results if row["outcome"] == "validate")
    errors = collections.Counter(row["message"] for row in results if "message" in row)
    times = sorted(row["ms"] for row in results if row["outcome"] == "compiled")
    tally = (
        generate_and_validate(results, samples, args.samples, args.attempts) if args.samples else {}
    )
    total = len(results)
    summary = {
        "outputs_invalid": tally.get("invalid", 0),
        "samples": total,
        "compiled": outcomes["compiled"],
        "compiled_pct": 100 * outcomes["compiled"] / max(total, 1),
        "validate": outcomes["validate"],
        "compiled_or_validate_pct": 100
        * (outcomes["compiled"] + outcomes["validate"])
        / max(total, 1),
        "refused": outcomes["refused"],
        "errors": outcomes["error"],
        "compile_ms_p50": statistics.median(times) if times else None,
        "compile_ms_p90": times[int(0.9 * (len(times) - 1))] if times else None,
        "compile_ms_max": times[-1] if times else None,
        "backend_refusals": sum(1 for row in results if row.get("backend")),
        "outputs_valid": tally.get("valid", 0),
        "outputs_unfinished": tally.get("unfinished", 0),
        "outputs_unchecked": tally.get("unchecked", 0),
        "validate_valid": tally.get("retry_valid", 0),
        "validate_exhausted": tally.get("retry_exhausted", 0),
        "validate_unchecked": tally.get("retry_unchecked", 0),
        "validate_mean_attempts": tally.get("retry_attempts", 0)
        / max(tally.get("retry_valid", 0), 1),
    }
    # The contract first: a finished output that breaks its schema is the one result that
    # must stay 0; then what was enforced, refused, and what a refusal showed of the backend.
    print_table(
        ["invalid outputs", "valid", "compiled", "validate", "refused", "errors", "backend"],
        [
            [
                summary["outputs_invalid"],
                summary["outputs_valid"],
                f"{outcomes['compiled']} ({summary['compiled_pct']:.1f}%)",
                outcomes["validate"],
                outcomes["refused"],
                outcomes["error"],
                summary["backend_refusals"],
            ]
        ],
    )
    print()
    print_table(["metric", "value"], [[k, v] for k, v in summary.items()])
    if relaxed:
        print("\nrefused exactly, enforced by validate-and-retry, by keyword:")
        print_table(["keyword", "samples"], [[k, n] for k, n in relaxed.most_common()])
    if keywords:
        print("\nrefused by keyword:")
        print_table(["keyword", "samples"], [[k, n] for k, n in keywords.most_common()])
    if errors:
        print("\nerrors:")
        print_table(["message", "samples"], [[k, n] for k, n in errors.most_common(15)])
    invalid = [(row["name"], row["invalid"]) for row in results if "invalid" in row]
    for name, found in invalid[:10]:
        print(f"INVALID {name}: {found[0]}")
    write_json(
        "schema_bench",
        {
            "summary": summary,
            "refused_by_keyword": dict(keywords),
            "validate_by_keyword": dict(relaxed),
            "errors": dict(errors),
            "per_sample": [{k: v for k, v in row.items() if k != "prepared"} for row in results],
        },
        args.out,
    )


if __name__ == "__main__":
    main()

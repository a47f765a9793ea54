"""The files and requests users bring, on the device under test: a GGUF file with quantized
blocks, and JSON-schema-constrained generation.

A lent GPU machine cannot carry the built-in SmolLM2 GGUF (98 MB, over what travels), so each
test model is written here as a Q4_1 GGUF with the benchmarks' exporter. On a GPU its blocks are
dequantized at load (``quantization none``: no quantized kernels run there), so the weights are
the same float32 numbers on both sides, and greedy tokens on the device must equal CPU float32's
from the same file. The constrained check runs the JSON grammar's masks on the device: greedy
tokens under a JSON schema must equal the CPU's, and every output that finished must parse and
match the schema.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.checks import (
    FAIL,
    INFO,
    PASS,
    SKIPPED,
    Check,
    Deadline,
    compare_tokens,
    error_check,
)
from benchmarks.gpu_check.engine_checks import REFERENCE, plan_for, release_memory
from runtime import Engine
from runtime.test_model import cached_test_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["pilot", "nurse", "teacher"]},
    },
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}
CONSTRAINED_PROMPTS = (
    "Describe a person as JSON:",
    "<|im_start|>user\nGive me a JSON object with name, age and job.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "{",
)


def _generate(
    model_path: str, jobs: list[tuple[tuple[str, ...], dict[str, Any]]], **engine_kwargs: Any
) -> list[list[dict[str, Any]]]:
    """Each job's (prompts, sampling params) results, all from one Engine."""
    with Engine(model_path, **engine_kwargs) as engine:
        results = [list(engine.generate(list(prompts), params)) for prompts, params in jobs]
    release_memory()
    return results


def _schema_verdicts(results: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """(finished, finished and valid, problems) of constrained outputs."""
    import jsonschema

    finished = valid = 0
    problems: list[str] = []
    for i, result in enumerate(results):
        reason = result["meta_info"].get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "length":
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(result["text"]), SCHEMA)
            valid += 1
        except Exception as exc:
            problems.append(f"prompt {i}: {type(exc).__name__}: {str(exc)[:80]}")
    return finished, valid, problems


def run_format_checks(smoke: bool, deadline: Deadline) -> list[Check]:
    """For each test model: its Q4_1 GGUF on the device against CPU float32 (free and
    JSON-schema-constrained greedy tokens), and the constrained outputs' validity."""
    from benchmarks.suite.systems.gguf_export import export_gguf

    plan = plan_for(smoke)
    target = next(t for t in plan.targets if t.gating)
    # Dequantized on both sides: on CPU, quantization auto would run the blocks in the
    # quantized kernels, whose activation rounding a GPU does not share.
    common = {"max_total_tokens": plan.max_total_tokens, "quantization": "none"}
    device_kwargs = {**common, **target.engine_kwargs}
    reference_kwargs = {**common, **REFERENCE}
    free = {"max_new_tokens": plan.new_tokens, "temperature": 0.0, "ignore_eos": True}
    constrained = {
        "max_new_tokens": 12 if smoke else 96,
        "temperature": 0.0,
        "json_schema": json.dumps(SCHEMA),
    }
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="arbor-gpu-check-gguf-") as folder:
        for preset, arch in plan.models:
            model = f"{preset} {arch} Q4_1 GGUF"
            if deadline.left() < 20:
                checks.append(Check(f"{model}: {target.label}", SKIPPED, "out of time", False))
                continue
            try:
                gguf_path = str(
                    export_gguf(
                        cached_test_model(preset, arch), Path(folder) / f"{preset}.gguf", "Q4_1"
                    )
                )
            except Exception as exc:
                checks.append(error_check(f"{model}: export", exc))
                continue
            jobs = [(plan.prompts, free), (CONSTRAINED_PROMPTS, constrained)]
            name = f"{model}: {target.label}"
            try:
                expected = _generate(gguf_path, jobs, **reference_kwargs)
                actual = _generate(gguf_path, jobs, **device_kwargs)
            except Exception as exc:
                checks.append(error_check(name, exc))
                continue
            labels = ("greedy", "json_schema greedy")
            for label, got, want in zip(labels, actual, expected, strict=True):
                checks.append(
                    compare_tokens(
                        f"{name} {label} = cpu float32",
                        [r["output_ids"] for r in got],
                        [r["output_ids"] for r in want],
                    )
                )
            finished, valid, problems = _schema_verdicts(actual[1])
            status = PASS if valid == finished else FAIL
            if finished == 0:
                status = INFO  # random weights may run to max_new_tokens
            detail = f"{valid}/{finished} finished outputs match the schema " + (
                f"({len(CONSTRAINED_PROMPTS) - finished} cut at max_new_tokens)"
            )
            if problems:
                detail += "; " + "; ".join(problems[:2])
            checks.append(
                Check(
                    f"{name} json_schema outputs valid",
                    status,
                    detail,
                    status != INFO,
                    {"finished": finished, "valid": valid},
                )
            )
    return checks

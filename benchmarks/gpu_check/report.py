"""The run's result as markdown, ready to paste into docs/benchmarks.md, and its verdict."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check.checks import ERROR, FAIL, Row


def failed_checks(sections: list[dict[str, Any]]) -> list[str]:
    """``section: check`` for every gating check that failed or raised."""
    return [
        f"{section['name']}: {check['name']}"
        for section in sections
        for check in section["checks"]
        if check["gating"] and check["status"] in (FAIL, ERROR)
    ]


def headline(payload: dict[str, Any]) -> str:
    env = payload["environment"]
    versions = (
        f"torch {env['torch']} (CUDA {env['cuda'] or 'none'}), triton {env['triton']}, "
        f"transformers {env['transformers']}, xgrammar {env['xgrammar']}, Python {env['python']}"
    )
    if payload["mode"] == "cpu-smoke":
        machine = "CPU smoke run (no GPU; triton interpreted, tiny sizes)"
    else:
        machine = (
            f"{env['gpu']} ({env['capability']}, {env['multiprocessors']} SMs, "
            f"{env['gpu_memory_gib']} GiB, driver {env['driver']})"
        )
    spent = f"{payload['elapsed_s']:.0f} s of a {payload['budget_s']:.0f} s budget"
    return f"{machine}; {versions}; {spent}."


def markdown(payload: dict[str, Any]) -> str:
    """A results table (one row per check), the verdict, then each benchmark table."""
    lines = [
        f"### GPU validation ({payload['date']}, `benchmarks/gpu_check`)",
        "",
        headline(payload),
        "",
        "| section | check | result | detail |",
        "|---|---|---|---|",
    ]
    for section in payload["sections"]:
        if not section["checks"]:
            lines.append(f"| {section['name']} | - | {section['status']} | "
                         f"{_cell(section.get('detail', ''))} |")  # fmt: skip
        for check in section["checks"]:
            lines.append(
                f"| {section['name']} | {_cell(check['name'])} | {check['status']} | "
                f"{_cell(check['detail'])} |"
            )
    failed = payload["failed"]
    verdict = f"**FAIL**: {'; '.join(failed)}" if failed else "**PASS**: every gating check passed"
    lines += ["", verdict]
    for section in payload["sections"]:
        for title, rows in section.get("tables", {}).items():
            if rows:
                lines += ["", f"#### {title}", "", *table(rows)]
    return "\n".join(lines)


def table(rows: list[Row]) -> list[str]:
    """Rows of equal keys as markdown table lines."""
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(_fmt(row.get(h, ""))) for h in headers) + " |")
    return lines


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")

"""What a check reports, the comparisons that decide it, and the clock the sections run against."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

PASS, FAIL, ERROR, INFO, SKIPPED = "pass", "fail", "error", "info", "skipped"
Row = dict[str, Any]


@dataclass
class Check:
    """One line of the report. ``gating`` checks decide the exit code: a gating check that
    failed or raised makes the run fail; ``info`` lines (bf16 agreement, timings) never do."""

    name: str
    status: str
    detail: str = ""
    gating: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.gating and self.status in (FAIL, ERROR)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def error_check(name: str, exc: BaseException, gating: bool = True) -> Check:
    """A check that could not run to its verdict because ``exc`` was raised."""
    message = str(exc).strip().splitlines()
    return Check(name, ERROR, f"{type(exc).__name__}: {message[0] if message else ''}", gating)


class Deadline:
    """Seconds left until a fixed point in time (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass(frozen=True)
class TensorError:
    """How far ``actual`` is from ``expected``: the largest absolute difference (inf when a
    value is non-finite on one side only, or NaN anywhere), the largest difference as a share
    of the allowed ``atol + rtol * |expected|`` (above 1: out of tolerance), and the count of
    elements out of tolerance."""

    max_abs: float
    worst_share: float
    mismatched: int
    total: int

    @property
    def ok(self) -> bool:
        return self.mismatched == 0


def tensor_error(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float
) -> TensorError:
    """Compare two tensors of one shape element by element, in float64.

    Equal values (-inf where both mask a token, say) count as equal; a NaN never does, so a
    kernel that reads a poisoned slot cannot pass.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    same = a == b
    diff = torch.where(same, 0.0, (a - b).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
    allowed = atol + rtol * b.abs()
    outside = ~same & (~a.isfinite() | ~b.isfinite() | (diff > allowed))
    # A non-finite value off by inf from a finite one, or inf / inf: an infinite share.
    share = torch.where(same, 0.0, diff / allowed).nan_to_num(nan=math.inf, posinf=math.inf)
    if not diff.numel():
        return TensorError(0.0, 0.0, 0, 0)
    return TensorError(float(diff.max()), float(share.max()), int(outside.sum()), a.numel())


def first_divergence(actual: list[int], expected: list[int]) -> int | None:
    """The first position where two token sequences differ (a length difference counts), or
    None when they are equal."""
    for position, (got, want) in enumerate(zip(actual, expected, strict=False)):
        if got != want:
            return position
    return None if len(actual) == len(expected) else min(len(actual), len(expected))


def compare_tokens(
    name: str, actual: list[list[int]], expected: list[list[int]], gating: bool = True
) -> Check:
    """Token ids of each prompt must be identical; the verdict names the first divergence.

    A gating comparison passes or fails; a non-gating one is ``info`` and reports the agreement:
    the share of expected tokens generated before each prompt's first divergence.
    """
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} outputs for {len(expected)} prompts")
    diverged: list[tuple[int, int]] = []  # (prompt, position)
    for prompt, (got, want) in enumerate(zip(actual, expected, strict=True)):
        position = first_divergence(got, want)
        if position is not None:
            diverged.append((prompt, position))
    total = sum(len(e) for e in expected)
    agreed = total - sum(len(expected[i]) - pos for i, pos in diverged)
    agreement = agreed / total if total else 1.0
    identical = len(expected) - len(diverged)
    metrics: dict[str, Any] = {
        "prompts": len(expected),
        "identical": identical,
        "agreement": agreement,
    }
    first = ""
    if diverged:
        i, pos = diverged[0]
        token = actual[i][pos] if pos < len(actual[i]) else "end"
        wanted = expected[i][pos] if pos < len(expected[i]) else "end"
        first = f"; first divergence: prompt {i}, token {pos}: {token} (expected {wanted})"
        metrics["first_divergence"] = {"prompt": i, "position": pos}
    summary = f"{identical}/{len(expected)} prompts identical"
    if not gating:
        return Check(name, INFO, f"agreement {agreement:.1%}, {summary}{first}", False, metrics)
    if diverged:
        return Check(name, FAIL, summary + first, True, metrics)
    return Check(name, PASS, f"{summary}, {total} tokens", True, metrics)

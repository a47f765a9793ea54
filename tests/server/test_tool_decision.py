"""The generic format's call-or-answer decision (runtime/server/tool_decision.py), without a
model: the threshold's choice, the calibration's once-only run, what decide() returns."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.server import tool_decision
from runtime.server.generic_tools import ReplyEnvelope, reply_envelope
from runtime.server.tool_decision import Threshold, ToolDecider, choose_threshold


def test_threshold_cuts_between_the_classes():
    scored = [(-7.0, True), (-6.0, True), (-8.0, True), (-12.0, False), (-10.0, False)]
    threshold = choose_threshold(scored, 0.8)
    assert threshold.accuracy == 1.0 and threshold.value == -9.0


def test_threshold_takes_the_median_of_tied_cuts_and_refuses_a_poor_one():
    # one answer-wanting prompt scores above a call-wanting one: two cuts classify 5 of 6
    scored = [
        (-5.0, True),
        (-9.0, True),
        (-7.0, False),
        (-11.0, False),
        (-4.0, True),
        (-12.0, False),
    ]
    threshold = choose_threshold(scored, 0.8)
    assert threshold.accuracy == pytest.approx(5 / 6)
    assert threshold.value is not None and -9.0 < threshold.value < -5.0
    assert choose_threshold(scored, 0.9).value is None  # below the bar: the model's own pick
    assert choose_threshold([(-1.0, True), (-2.0, True)], 0.5).value is None  # one side only
    assert choose_threshold([], 0.5).value is None


def test_reply_envelope_modes():
    assert reply_envelope(False, True, None).scored
    assert reply_envelope(False, True, "scored").scored
    constrained = reply_envelope(False, True, "constrained")
    assert constrained.constrained and not constrained.scored
    free = reply_envelope(False, True, "free")
    assert not free.constrained and not free.scored


def test_decide_calibrates_once_and_cuts(monkeypatch: pytest.MonkeyPatch):
    calls: list[bool] = []

    async def calibrate(state: Any, parallel: bool) -> Threshold:
        calls.append(parallel)
        await asyncio.sleep(0.01)
        return Threshold(-9.0, 0.9)

    async def name_score(
        state: Any, ids: Any, names: Any, parallel: bool, salt: Any = None
    ) -> float:
        return {"near": -3.0, "far": -15.0}[names[0]]

    monkeypatch.setattr(tool_decision, "calibrate", calibrate)
    monkeypatch.setattr(tool_decision, "name_score", name_score)
    decider = ToolDecider()
    envelope = ReplyEnvelope(False, scored=True)

    async def run() -> list[str | None]:
        return await asyncio.gather(
            decider.decide(None, [1], ["near"], envelope),
            decider.decide(None, [1], ["far"], envelope),
            decider.decide(None, [1], ["near"], ReplyEnvelope(False)),  # not scored
            decider.decide(None, [1], [], envelope),  # no tool
            decider.decide(None, [1], ["near"] * 33, envelope),  # too many to score
        )

    assert asyncio.run(run()) == ["call", "answer", None, None, None]
    assert calls == [False]  # one calibration, shared by the concurrent requests


def test_an_unusable_threshold_leaves_the_choice_to_the_model(monkeypatch: pytest.MonkeyPatch):
    async def calibrate(state: Any, parallel: bool) -> Threshold:
        return Threshold(None, 0.6)

    async def name_score(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("nothing to score against")

    monkeypatch.setattr(tool_decision, "calibrate", calibrate)
    monkeypatch.setattr(tool_decision, "name_score", name_score)
    decider = ToolDecider()
    assert asyncio.run(decider.decide(None, [1], ["x"], ReplyEnvelope(True, scored=True))) is None


def test_a_failed_scoring_leaves_the_choice_to_the_model(monkeypatch: pytest.MonkeyPatch):
    async def calibrate(state: Any, parallel: bool) -> Threshold:
        raise RuntimeError("the scheduler stopped")

    monkeypatch.setattr(tool_decision, "calibrate", calibrate)
    decider = ToolDecider()
    envelope = ReplyEnvelope(False, scored=True)
    assert asyncio.run(decider.decide(None, [1], ["x"], envelope)) is None
    assert asyncio.run(decider.threshold(None, False)) == Threshold(None, 0.0)  # kept, not retried

    async def usable(state: Any, parallel: bool) -> Threshold:
        return Threshold(-5.0, 1.0)

    async def refused(*args: Any) -> float:
        raise ValueError("the prompt fills the context")

    monkeypatch.setattr(tool_decision, "calibrate", usable)
    monkeypatch.setattr(tool_decision, "name_score", refused)
    assert asyncio.run(ToolDecider().decide(None, [1], ["x"], envelope)) is None

"""The generic format's call-or-answer decision (runtime/server/tool_decision.py), without a
model: the threshold's choice, the calibration's once-only run, what decide() returns."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
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


class _Ids:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids


class _State:
    """A tokenizer of one id per character (or, ``merge``, the opening's last quote merged
    with the name's first letter), and a model whose every token has log-probability -1 but
    the name's first letter, -0.5 after the opening."""

    def __init__(self, merge: bool = False) -> None:
        self.merge = merge
        self.requests: list[tuple[int, int]] = []  # (ids, logprob_start_len)
        self.tokenizer = self._tokenize
        self.tokenizer_manager = self

    def _tokenize(self, text: str, add_special_tokens: bool = False) -> _Ids:
        ids = [ord(c) for c in text]
        if self.merge and '"g' in text:
            at = text.index('"g')
            ids[at : at + 2] = [1000]
        return _Ids(ids)

    async def run_tokenizer(self, work: Any, field: str) -> Any:
        return work()

    async def generate(self, ids: list[int], params: Any, **options: Any) -> Any:
        start = options["logprob_start_len"]
        self.requests.append((len(ids), start))
        entries = [(-0.5 if t in (ord("g"), 1000) else -1.0, t, []) for t in ids[start:]]
        yield SimpleNamespace(input_logprobs=entries)


def test_name_score_reads_only_the_names_tokens():
    """One request per tool, its logprobs from the end of the opening on: the name's tokens
    (``get_weather"``: g at -0.5, eleven more at -1)."""
    state = _State()
    score = asyncio.run(tool_decision.name_score(state, [1, 2, 3], ["get_weather"], False))
    assert score == pytest.approx(-11.5)
    opening = len(tool_decision.call_opening(False))
    assert state.requests == [(3 + opening + 12, 3 + opening)]


def test_name_score_subtracts_the_opening_where_tokens_merge_across_it():
    """When the opening's last token merges with the name's first, the call is scored whole
    and the opening's own log-probability taken off."""
    state = _State(merge=True)
    score = asyncio.run(tool_decision.name_score(state, [1, 2, 3], ["get_weather"], False))
    opening = len(tool_decision.call_opening(False))
    # whole call: opening - 1 tokens at -1, the merged token at -0.5, "et_weather\"" at -1
    # each (11); minus the opening alone (opening tokens at -1)
    assert score == pytest.approx(-(opening - 1) - 0.5 - 11 + opening)
    assert len(state.requests) == 2

"""The generic format's call-or-answer decision (runtime/server/tool_decision.py), without a
model: the threshold's choice, the calibration's once-only run, what decide() returns."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runtime.chat import tool_decision
from runtime.chat.generic_tools import ReplyEnvelope, reply_envelope
from runtime.chat.tool_decision import Threshold, ToolDecider, choose_threshold
from runtime.chat.tool_thresholds import ThresholdStore, calibration_digest


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


def _scores(monkeypatch: pytest.MonkeyPatch, threshold: Threshold, calls: list[bool]) -> None:
    """A calibration that returns ``threshold`` (noting each shape it runs for) and names that
    score -3 ("near") or -15 ("far"), with no model."""

    async def prompts(state: Any, parallel: bool) -> list[list[int]]:
        return [[1]] * len(tool_decision.CALIBRATION_PROMPTS)

    async def calibrate(state: Any, parallel: bool, ids: Any) -> Threshold:
        calls.append(parallel)
        await asyncio.sleep(0.01)
        return threshold

    async def name_score(
        state: Any, ids: Any, names: Any, parallel: bool, salt: Any = None
    ) -> float:
        return {"near": -3.0, "far": -15.0}[names[0]]

    monkeypatch.setattr(tool_decision, "calibration_prompts", prompts)
    monkeypatch.setattr(tool_decision, "calibrate", calibrate)
    monkeypatch.setattr(tool_decision, "name_score", name_score)


def test_prepare_calibrates_each_shape_then_decisions_cut(monkeypatch: pytest.MonkeyPatch):
    calls: list[bool] = []
    _scores(monkeypatch, Threshold(-9.0, 0.9), calls)
    decider = ToolDecider()
    envelope = ReplyEnvelope(False, scored=True)

    async def run() -> list[str | None]:
        await decider.prepare(None, None)
        return await asyncio.gather(
            decider.decide(None, [1], ["near"], envelope),
            decider.decide(None, [1], ["far"], envelope),
            decider.decide(None, [1], ["near"], ReplyEnvelope(True, scored=True)),
            decider.decide(None, [1], ["near"], ReplyEnvelope(False)),  # not scored
            decider.decide(None, [1], [], envelope),  # no tool
            decider.decide(None, [1], ["near"] * 33, envelope),  # too many to score
        )

    assert asyncio.run(run()) == ["call", "answer", "call", None, None, None]
    assert calls == [True, False]  # at startup, once per shape; no request calibrated
    assert decider.sources == {"startup": 2}


def test_an_uncalibrated_shape_does_not_hold_up_the_request(monkeypatch: pytest.MonkeyPatch):
    """Without a startup calibration, the first requests go on at once (the model picks the
    key) while one calibration runs in the background; later requests use its threshold."""
    calls: list[bool] = []
    _scores(monkeypatch, Threshold(-9.0, 0.9), calls)
    decider = ToolDecider()
    envelope = ReplyEnvelope(True, scored=True)

    async def run() -> tuple[list[str | None], str | None]:
        first = await asyncio.gather(
            decider.decide(None, [1], ["near"], envelope),
            decider.decide(None, [1], ["near"], envelope),
        )
        await asyncio.sleep(0.1)  # the background calibration ends
        return first, await decider.decide(None, [1], ["near"], envelope)

    first, later = asyncio.run(run())
    assert first == [None, None] and later == "call"
    assert calls == [True]  # once, shared by the concurrent requests
    assert decider.sources == {"request": 1}


def test_an_unusable_threshold_leaves_the_choice_to_the_model(monkeypatch: pytest.MonkeyPatch):
    calls: list[bool] = []
    _scores(monkeypatch, Threshold(None, 0.6), calls)

    async def name_score(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("nothing to score against")

    monkeypatch.setattr(tool_decision, "name_score", name_score)
    decider = ToolDecider()

    async def run() -> str | None:
        await decider.prepare(None, None)
        return await decider.decide(None, [1], ["x"], ReplyEnvelope(True, scored=True))

    assert asyncio.run(run()) is None


def test_a_failed_scoring_leaves_the_choice_to_the_model(monkeypatch: pytest.MonkeyPatch):
    calls: list[bool] = []
    _scores(monkeypatch, Threshold(-5.0, 1.0), calls)

    async def failing(state: Any, parallel: bool, ids: Any) -> Threshold:
        raise RuntimeError("the scheduler stopped")

    monkeypatch.setattr(tool_decision, "calibrate", failing)
    decider = ToolDecider()
    envelope = ReplyEnvelope(False, scored=True)
    asyncio.run(decider.prepare(None, None))
    assert asyncio.run(decider.decide(None, [1], ["x"], envelope)) is None
    assert decider.threshold(None, False) == Threshold(None, 0.0)  # kept, not retried

    async def refused(*args: Any) -> float:
        raise ValueError("the prompt fills the context")

    monkeypatch.setattr(tool_decision, "calibrate", _usable)
    monkeypatch.setattr(tool_decision, "name_score", refused)
    usable = ToolDecider()
    asyncio.run(usable.prepare(None, None))
    assert asyncio.run(usable.decide(None, [1], ["x"], envelope)) is None


async def _usable(state: Any, parallel: bool, ids: Any) -> Threshold:
    return Threshold(-5.0, 1.0)


def test_prepare_keeps_the_threshold_and_a_restart_reads_it_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """The first start calibrates and writes the file; the next reads it (no calibration);
    other prompts' ids (a changed template) or other numerics calibrate anew."""
    calls: list[bool] = []
    _scores(monkeypatch, Threshold(-9.0, 0.9), calls)
    monkeypatch.setattr(tool_decision, "model_identity", lambda path: "ab" * 32)
    store = ThresholdStore(tmp_path)
    state = SimpleNamespace(
        args=SimpleNamespace(model_path="model.gguf"),
        tokenizer_manager=SimpleNamespace(server_info={"dtype": "float32"}),
    )

    def start() -> ToolDecider:
        decider = ToolDecider()
        asyncio.run(decider.prepare(state, store))
        return decider

    assert start().sources == {"startup": 2} and calls == [True, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{'ab' * 16}-one-call.json",
        f"{'ab' * 16}-parallel.json",
    ]
    again = start()
    assert again.sources == {"cache": 2} and calls == [True, False]
    assert again.threshold(state, True) == Threshold(-9.0, 0.9)
    state.tokenizer_manager.server_info["dtype"] = "bfloat16"
    assert start().sources == {"startup": 2} and calls == [True, False] * 2


def test_threshold_store_ignores_other_digests_and_broken_files(tmp_path: Path):
    store = ThresholdStore(tmp_path)
    identity = "cd" * 32
    digest = calibration_digest(identity, True, [[1, 2, 3]], {"numerics": {}})
    assert store.load(identity, True, digest) is None
    store.save(identity, True, digest, Threshold(None, 0.5))
    assert store.load(identity, True, digest) == Threshold(None, 0.5)
    other = calibration_digest(identity, True, [[1, 2, 4]], {"numerics": {}})
    assert other != digest and store.load(identity, True, other) is None
    assert store.load(identity, False, digest) is None  # the other shape's file
    store.path(identity, True).write_text("{not json")
    assert store.load(identity, True, digest) is None
    assert [p.name for p in tmp_path.iterdir()] == [store.path(identity, True).name]


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

"""Each workload's harness on the tiny model, at tiny sizes: what it traces is the work the
baselines replay, so the trace must be complete, ordered and faithful."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.suite.metrics import optimal_hit_rate, output_agreement, summarize
from benchmarks.suite.systems.transformers_baseline import TransformersBaseline
from benchmarks.suite.trace import SystemRun
from benchmarks.suite.workloads import (
    WORKLOADS,
    Agent,
    FewShot,
    JsonExtraction,
    MultiTurn,
    RandomLengths,
    TreeOfThought,
)
from runtime import Engine

TINY = {
    "few-shot": FewShot(questions=3, shots=2, question_words=8, output_len=4),
    "random": RandomLengths(requests_count=3, input_len=(4, 16), output_len=(2, 5)),
    "json": JsonExtraction(records=2, record_sentences=1, max_tokens=64),
    "multi-turn": MultiTurn(sessions=2, turns=(2, 3), user_sentences=(1, 1), output_len=(2, 4)),
    "tree-of-thought": TreeOfThought(problems=1, width=2, depth=2, max_tokens=3),
    "agent": Agent(tasks=2, max_steps=2, min_steps=1, max_tokens=3),
}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model_path), dtype="float32", max_total_tokens=16384) as running:
        yield running


@pytest.fixture(scope="module")
def runs(engine: Engine) -> dict[str, SystemRun]:
    return {name: workload.run_arbor(engine) for name, workload in TINY.items()}


def test_every_workload_is_covered() -> None:
    assert set(TINY) == set(WORKLOADS)
    for workload in WORKLOADS.values():
        quick, full = workload.preset(True), workload.preset(False)
        assert getattr(quick, quick.count_field) < getattr(full, full.count_field)


@pytest.mark.parametrize("name", list(TINY))
def test_trace_is_complete_and_in_sending_order(runs: dict[str, SystemRun], name: str) -> None:
    run = runs[name]
    assert run.calls and len(run.calls) == len(run.timings) == len(run.outputs)
    arrivals = [t.arrival for t in run.timings]
    assert arrivals == sorted(arrivals)
    for call, timing, output in zip(run.calls, run.timings, run.outputs, strict=True):
        assert output == call.output_ids
        assert len(timing.token_times) == call.output_len
        assert all(timing.arrival <= t <= timing.finish for t in timing.token_times)
    summary = summarize(run)
    assert summary["output_tokens"] == sum(c.output_len for c in run.calls)
    assert summary["output_tokens_per_s"] > 0 and summary["ttft_p50_s"] > 0
    assert run.cache_hit_rate is not None and 0 <= run.cache_hit_rate <= 1


@pytest.mark.parametrize("name", ["few-shot", "random"])
def test_fixed_lengths_are_exact(runs: dict[str, SystemRun], engine: Engine, name: str) -> None:
    workload = TINY[name]
    assert isinstance(workload, FewShot | RandomLengths)
    requests = workload.requests(engine.tokenizer)
    by_prompt = {r.prompt_ids: r.max_new_tokens for r in requests}
    assert sorted(c.prompt_ids for c in runs[name].calls) == sorted(by_prompt)
    assert all(c.output_len == by_prompt[c.prompt_ids] for c in runs[name].calls)


def test_shared_prefixes_are_reused(runs: dict[str, SystemRun]) -> None:
    for name in ("few-shot", "multi-turn", "tree-of-thought", "agent"):
        run = runs[name]
        optimal = optimal_hit_rate(run.calls)
        assert optimal > 0.3, name
        assert run.cache_hit_rate == pytest.approx(optimal, abs=0.1), name


def test_multi_turn_resends_history(runs: dict[str, SystemRun]) -> None:
    calls = runs["multi-turn"].calls
    for group in {c.group for c in calls}:
        turns = sorted((c for c in calls if c.group == group), key=lambda c: c.wave)
        assert [c.wave for c in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:], strict=False):
            history = before.prompt_ids + before.output_ids
            assert after.prompt_ids[: len(history)] == history


def test_programs_trace_forks_selects_and_constraints(runs: dict[str, SystemRun]) -> None:
    tree = runs["tree-of-thought"].calls
    waves = [(c.group, c.wave) for c in tree if c.output_len]
    assert any(waves.count(w) >= 2 for w in waves)  # fork branches generate side by side
    assert any(c.output_len == 0 for c in tree)  # select's scoring calls
    agent = runs["agent"].calls
    assert len({c.group for c in agent}) == 2
    assert any(c.constrained for c in agent) and any(c.output_len == 0 for c in agent)
    assert all(c.constrained for c in runs["json"].calls)


def test_transformers_replays_the_same_work(
    runs: dict[str, SystemRun], tiny_model_path: Path
) -> None:
    ours = runs["multi-turn"]
    theirs = TransformersBaseline(str(tiny_model_path), batch_size=2).replay(ours.calls)
    assert [len(t.token_times) for t in theirs.timings] == [c.output_len for c in ours.calls]
    assert output_agreement(ours, theirs) == pytest.approx(1.0, abs=0.25)
    for call, timing in zip(theirs.calls, theirs.timings, strict=True):
        earlier = [
            t.finish
            for c, t in zip(theirs.calls, theirs.timings, strict=True)
            if c.group == call.group and c.wave < call.wave
        ]
        assert timing.arrival == max(earlier, default=0.0)  # sent once its history exists
        assert timing.token_times[0] > timing.arrival


@pytest.fixture(scope="module")
def compiled_runs(engine: Engine) -> dict[str, SystemRun]:
    programs = ("tree-of-thought", "agent")
    runs = {name: TINY[name].run_arbor_compiled(engine) for name in programs}
    return {name: run for name, run in runs.items() if run is not None}


def test_only_program_workloads_run_compiled(engine: Engine) -> None:
    assert TINY["random"].run_arbor_compiled(engine) is None


@pytest.mark.parametrize("name", ["tree-of-thought", "agent"])
def test_compiled_runs_are_traced_per_op(
    runs: dict[str, SystemRun], compiled_runs: dict[str, SystemRun], name: str
) -> None:
    run = compiled_runs[name]
    assert run.system == "arbor-compiled" and "program requests per program" in run.note
    for call, timing in zip(run.calls, run.timings, strict=True):
        assert len(timing.token_times) == call.output_len
        assert all(timing.arrival <= t <= timing.finish for t in timing.token_times)
    summary = summarize(run)
    assert summary["output_tokens"] > 0 and summary["ttft_p50_s"] > 0
    assert {c.group for c in run.calls} == {c.group for c in runs[name].calls}
    assert run.cache_hit_rate is not None and run.cache_hit_rate > 0.3


def test_compiled_tree_of_thought_makes_the_same_gens_in_fewer_calls(
    runs: dict[str, SystemRun], compiled_runs: dict[str, SystemRun]
) -> None:
    interpreted, compiled = runs["tree-of-thought"], compiled_runs["tree-of-thought"]
    gens = [sum(c.output_len > 0 for c in r.calls) for r in (interpreted, compiled)]
    assert gens[0] == gens[1] == 2 + 4 + 1  # width 2, depth 2, then the answer
    assert len(compiled.calls) < len(interpreted.calls)  # no fork or select prefix requests
    assert "2.0 program requests per program" in compiled.note  # the leaves' scores are read
    waves = [(c.group, c.wave) for c in compiled.calls if c.output_len]
    assert any(waves.count(w) >= 2 for w in waves)  # branches generate side by side

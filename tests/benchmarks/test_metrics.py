"""The numbers the benchmark tables are made of: percentiles, latencies, hit rates, waves."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.suite.contention import CpuSample, _descendants, others_share, sample
from benchmarks.suite.metrics import (
    inter_token_latencies,
    optimal_hit_rate,
    output_agreement,
    percentile,
    ttfts,
)
from benchmarks.suite.systems.arbor_programs import _ready_at
from benchmarks.suite.trace import Call, SystemRun, Timing, assign_waves, replay_arrival


def test_percentile_hand_cases() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert percentile(list(map(float, range(101))), 90) == 90.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.sampled_from([0, 1, 50, 90, 99, 100]),
)
def test_percentile_matches_numpy(values: list[float], q: int) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_ttft_and_itl_per_call() -> None:
    timings = [
        Timing(arrival=1.0, token_times=[1.5, 1.7, 1.7, 2.0], finish=2.0),
        Timing(arrival=0.0, token_times=[], finish=0.3),  # a scoring call: no tokens
        Timing(arrival=0.5, token_times=[0.75], finish=0.75),
    ]
    assert ttfts(timings) == pytest.approx([0.5, 0.25])
    # gaps within a call only; tokens of one chunk have a gap of 0
    assert inter_token_latencies(timings) == pytest.approx([0.2, 0.0, 0.3])


def call(prompt: list[int], output: list[int] = ()) -> Call:  # type: ignore[assignment]
    return Call(tuple(prompt), tuple(output))


def test_optimal_hit_rate_shared_prefix() -> None:
    # 4 prompts of 10 tokens sharing 8: the first pays everything, the others 2 each
    calls = [call([1] * 8 + [i, i]) for i in range(2, 6)]
    assert optimal_hit_rate(calls) == pytest.approx(24 / 40)


def test_optimal_hit_rate_counts_earlier_outputs_and_caps_at_len_minus_one() -> None:
    calls = [
        call([1, 2, 3], [4, 5]),  # nothing before it
        call([1, 2, 3, 4, 5, 6]),  # its history is the first call's prompt + output: 5 hits
        call([1, 2, 3]),  # fully cached, but one token must run: 2 hits
        call([9, 9]),  # nothing shared
    ]
    assert optimal_hit_rate(calls) == pytest.approx((0 + 5 + 2 + 0) / (3 + 6 + 3 + 2))


def test_optimal_hit_rate_only_looks_back() -> None:
    # the first call cannot reuse the second; the second reuses the whole first
    assert optimal_hit_rate([call([1, 2]), call([1, 2, 3, 4])]) == pytest.approx(2 / 6)
    assert optimal_hit_rate([]) == 0.0


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=8))
def test_optimal_hit_rate_matches_brute_force(prompts: list[list[int]]) -> None:
    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    hits = sum(
        min(max((common(p, q) for q in prompts[:i]), default=0), len(p) - 1)
        for i, p in enumerate(prompts)
    )
    expected = hits / sum(len(p) for p in prompts)
    assert optimal_hit_rate([call(p) for p in prompts]) == pytest.approx(expected)


def test_waves_from_timing_and_replay_arrivals() -> None:
    # group 0: a prefix call, then two branches side by side, then a final call
    calls = [Call((1,), (), group=0) for _ in range(4)] + [Call((2,), (5,), group=1)]
    timings = [
        Timing(0.0, [], 1.0),
        Timing(1.0, [], 2.0),
        Timing(1.1, [], 3.0),
        Timing(3.0, [], 4.0),
        Timing(0.0, [], 9.0),  # another group's call does not order group 0's
    ]
    waved = assign_waves(calls, timings)
    assert [c.wave for c in waved] == [0, 1, 1, 2, 0]
    finished = {(0, 0): 1.0, (0, 1): 3.0, (1, 0): 9.0}
    assert replay_arrival(waved[0], finished) == 0.0
    assert replay_arrival(waved[1], finished) == 1.0
    assert replay_arrival(waved[3], finished) == 3.0


def test_output_agreement_skips_constrained_and_scoring_calls() -> None:
    calls = [
        Call((1,), (2, 3)),
        Call((1,), (4,)),
        Call((1,), (5,), constrained=True),
        Call((1,), ()),
    ]
    ours = SystemRun("arbor", calls, [], [c.output_ids for c in calls], 1.0, None)
    theirs = SystemRun("x", calls, [], [(2, 3), (9,), (7,), ()], 1.0, None)
    assert output_agreement(ours, theirs) == 0.5


def test_others_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    start = CpuSample(machine_busy_s=100.0, process_s=10.0, wall_s=0.0)
    # 4 s of capacity; the machine was busy 3 s, of which 1 s was ours: others took half
    assert others_share(start, CpuSample(103.0, 11.0, 2.0)) == pytest.approx(0.5)
    assert others_share(start, CpuSample(101.0, 11.0, 2.0)) == 0.0  # never negative
    assert others_share(CpuSample(None, 0.0, 0.0), CpuSample(None, 1.0, 1.0)) is None
    before = sample()
    sum(i * i for i in range(300_000))
    assert sample().process_s > before.process_s


def test_ready_at_follows_branches_and_joins() -> None:
    ready = {"": 1.0, "/0.0": 3.0, "/0.1": 2.0, "/0.1/1.0": 5.0}
    assert _ready_at({}, "/0.0") == 0.0
    assert _ready_at(ready, "/0.0") == 3.0  # its own last op
    assert _ready_at(ready, "/0.0/2.1") == 3.0  # a new child: after its parent
    assert _ready_at(ready, "/0.1") == 5.0  # after its joined branch
    assert _ready_at(ready, "") == 5.0  # the root after the join of everything


def test_descendants_count_as_ours() -> None:
    # Processes this one already has (a shared server's, started by another module's tests on
    # this worker) are not the test's to kill.
    before = _descendants()
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while len(found := _descendants() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in found and len(found) >= 2  # the child and its own child
    finally:
        for pid in _descendants() - before:
            os.kill(pid, signal.SIGKILL)
        child.wait()

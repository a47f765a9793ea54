"""benchmarks/radix_cache_bench: the replay keeps the pool whole, and the SGLang baseline is
optional (skipped with the command that installs it) and replays the same trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import radix_cache_bench, sglang_radix
from benchmarks.radix_replay import OPS, make_trace

SLOTS = 1 << 14  # small enough that the trace evicts
INSTALL = sglang_radix.INSTALL_HINT.format(dir=sglang_radix.DEFAULT_DIR)


@pytest.fixture(scope="module")
def ours() -> dict:
    return radix_cache_bench.run_replay(make_trace(300), SLOTS, 1, "lru")  # checks invariants


def test_the_replay_reuses_and_evicts(ours: dict) -> None:
    assert ours["hit_rate"] > 0.2 and ours["evicted_tokens"] > 0
    assert all(ours["ops"][op]["calls"] > 0 for op in OPS)


def test_a_missing_sglang_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(sglang_radix.SGLangUnavailable, match="pip install --no-deps --target"):
        sglang_radix.load(tmp_path)


@pytest.mark.skipif(
    not (sglang_radix.DEFAULT_DIR / "sglang").is_dir(),
    reason=f"SGLang not installed: {INSTALL}",
)
def test_sglang_replays_the_same_trace(ours: dict) -> None:
    theirs = sglang_radix.run_replay(make_trace(300), SLOTS, sglang_radix.DEFAULT_DIR)
    # The same protocol over the same trace: the same calls, nearly the same hits (the two
    # trees break LRU ties differently), and no slot lost (run_replay counts them).
    assert theirs["ops"]["match_prefix"]["calls"] == pytest.approx(
        ours["ops"]["match_prefix"]["calls"], rel=0.02
    )
    assert theirs["hit_rate"] == pytest.approx(ours["hit_rate"], abs=0.02)
    table = sglang_radix.comparison(ours, theirs)
    assert set(table) == {*OPS, "insert+match"}

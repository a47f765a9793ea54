"""benchmarks/agent_session_bench in its smoke mode: three real servers on the tiny model (about
a minute on 2 busy cores, most of it their start), and the JSON holds every row, column, check
and target the docs' table is made of."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# What docs/benchmarks.md's table shows, spelled out here so that a row or column the benchmark
# stops writing fails the test.
ROWS = {"lru", "hints", "tool-wait"}
COLUMNS = ("ttft_p50_s", "ttft_p90_s", "hit_rate", "throughput_rps", "ttft_p50_vs_lru")


def test_smoke_run_reports_every_row_and_column(tmp_path: Path) -> None:
    out = tmp_path / "agent_session.json"
    command = [sys.executable, "-m", "benchmarks.agent_session_bench", "--smoke", "--out", str(out)]
    subprocess.run(command, check=True, timeout=300, capture_output=True)
    payload = json.loads(out.read_text())
    assert set(payload["rows"]) == ROWS
    for name, row in payload["rows"].items():
        assert all(isinstance(row[column], float) for column in COLUMNS), name
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert row["agent_turns"] == payload["sizes"]["loops"] * payload["sizes"]["turns"]
        assert row["flood_requests"] > 0
    assert payload["rows"]["lru"]["ttft_p50_vs_lru"] == 1.0
    assert payload["max_total_tokens"] * 4 <= payload["working_set_tokens"]
    cache_control = payload["cache_control"]
    assert cache_control["flood_tokens"] >= 10 * payload["max_total_tokens"]
    assert 0 <= cache_control["cached_with_cache_control"] <= cache_control["prefix_tokens"]
    tenants = payload["tenants"]
    names = {"quiet_solo_hit_rate", "quiet_flood_hit_rate", "ratio", "flood_tenant_tokens"}
    assert set(tenants) == names
    rounds = payload["sizes"]["quiet_rounds"]
    assert tenants["flood_tenant_tokens"] >= rounds * payload["max_total_tokens"]  # a pool a round
    assert payload["loops_tokens"] < payload["working_set_tokens"]  # the flood counts too
    assert [type(target["pass"]) for target in payload["targets"]] == [bool] * 4

"""``arbor bench`` end to end on the tiny model: the table, the JSON, the chart, and what
happens when an optional piece (matplotlib, llama.cpp) is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.suite.systems import llama_cpp_baseline
from benchmarks.suite.trace import Call
from runtime.cli import main


def test_bench_runs_arbor_and_transformers_side_by_side(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", "random", "--quick", "--requests", "2", "--model-path",
            str(tiny_model_path), "--baseline", "transformers", "--hf-batch", "2",
            "--quantization", "none", "--out", str(out)]  # fmt: skip
    plotting = _importable("matplotlib")
    if plotting:
        argv += ["--plot", str(tmp_path / "chart.png")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50 s" in printed and "arbor / transformers:" in printed
    result = json.loads(out.read_text())
    arbor, hf = result["systems"]
    assert (arbor["system"], hf["system"]) == ("arbor", "transformers")
    assert arbor["calls"] == hf["calls"] == 2
    assert arbor["output_tokens"] == hf["output_tokens"] > 0
    assert result["ratios"]["transformers"] == pytest.approx(
        arbor["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )
    assert result["command"][:3] == ["arbor", "bench", "random"]
    assert result["arbor_settings"] == {"dtype": "auto", "quantization": "none",
                                        "max_total_tokens": 131072}  # fmt: skip
    assert len(result["load_average"]["before"]) == 3
    if plotting:
        png = (tmp_path / "chart.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) < 100_000


def test_plot_without_matplotlib_fails_before_running(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    argv = ["bench", "random", "--model-path", str(tiny_model_path), "--plot", "x.png"]
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib: .*\[bench\]"):
        main(argv)


def test_llama_cpp_missing_is_reported_not_fatal(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    outcome = llama_cpp_baseline.replay(str(tiny_model_path), [Call((1, 2, 3), (4,))])
    assert outcome.run is None and "llama_cpp not importable" in outcome.reason


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_program_workloads_add_a_compiled_row(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", "tree-of-thought", "--quick", "--requests", "1", "--model-path",
            str(tiny_model_path), "--baseline", "none", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "arbor-compiled / arbor (interpreted):" in capsys.readouterr().out
    result = json.loads(out.read_text())
    interpreted, compiled = result["systems"]
    assert (interpreted["system"], compiled["system"]) == ("arbor", "arbor-compiled")
    assert result["ratios"] == {} and result["output_agreement"] == {}
    assert result["compiled_speedup"] == pytest.approx(
        compiled["output_tokens_per_s"] / interpreted["output_tokens_per_s"]
    )
    assert main([*argv, "--no-compiled"]) == 0
    assert [s["system"] for s in json.loads(out.read_text())["systems"]] == ["arbor"]

"""cpu_anchor_bench on a model path: each system's worker measures load, memory, prefill and
decode; rounds keep each number's best; a missing llama-server is reported, not fatal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import cpu_anchor_bench
from benchmarks.cpu_anchor_worker import measure


def _spec(model: Path) -> dict[str, object]:
    return {"model_path": str(model), "gguf": "", "prompt": list(range(10, 26)),
            "prompt_len": 16, "steps": 2, "repeat": 1,
            "batch_prompts": [list(range(30, 38)), list(range(40, 48))], "batches": [1, 2],
            "threads": 1, "dtype": "auto", "quantization": "auto"}  # fmt: skip


@pytest.mark.parametrize("system", ["arbor", "transformers"])
def test_worker_measures_load_and_speed(system: str, tiny_model_path: Path) -> None:
    # in process: memory freed by earlier tests may be reused, so RSS is checked end to end
    result = measure(system, _spec(tiny_model_path))
    assert result["load_s"] > 0 and {"rss_load_mb", "rss_peak_mb", "rss_run_mb"} <= set(result)
    assert result["prefill"] > 0 and result["decode_b1"] > 0 and result["decode_b2"] > 0


def test_arbor_runs_through_the_engine_with_the_dtype_and_quantization_given(
    tiny_model_path: Path,
) -> None:
    spec = {**_spec(tiny_model_path), "batch_prompts": [], "batches": [1]}
    result = measure("arbor", {**spec, "dtype": "bfloat16", "quantization": "none"})
    assert (result["dtype"], result["quantization"]) == ("bfloat16", "none")
    assert result["decode_b1"] > 0 and "decode_b2" not in result
    with pytest.raises(ValueError, match="quantization"):
        measure("arbor", {**spec, "quantization": "no-such-format"})


def test_rounds_keep_the_lowest_time_and_memory_and_the_highest_rates() -> None:
    best = cpu_anchor_bench._best(
        [
            {"load_s": 2.0, "rss_load_mb": 90.0, "prefill": 100.0, "others_cpu_share": 0.1},
            {"load_s": 1.0, "rss_load_mb": 95.0, "prefill": 80.0, "others_cpu_share": 0.4},
        ]
    )
    assert best == {"load_s": 1.0, "rss_load_mb": 90.0, "prefill": 100.0, "others_cpu_share": 0.4}
    assert (
        cpu_anchor_bench._best([{"unavailable": "no"}, {"unavailable": "no", "prefill": 5.0}])[
            "prefill"
        ]
        == 5.0
    )


def test_model_mode_reports_each_system_and_a_missing_llama_server(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARBOR_LLAMA_SERVER_BIN", str(tmp_path / "missing"))
    out = tmp_path / "anchor.json"
    monkeypatch.setattr(sys, "argv", ["cpu_anchor_bench", "--model-path", str(tiny_model_path),
                        "--prompt-len", "16", "--batch-context", "8", "--batches", "1,2",
                        "--steps", "2", "--out", str(out)])  # fmt: skip
    cpu_anchor_bench.main()
    result = json.loads(out.read_text())
    for system in ("arbor", "transformers"):
        best = result["best"][system]
        assert best["decode_b2"] > 0 and best["rss_load_mb"] > 1, best  # a fresh process each
    assert "llama-server unavailable" in result["best"]["llama.cpp"]["decode_b2"]
    assert result["best"]["arbor"]["dtype"] == "float32"  # auto, for a float32 checkpoint

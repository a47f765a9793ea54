"""gemv_roofline on a tiny quantized GGUF: every quantized layer is grouped by its packed
format, and a row reports GB/s of the GEMV and of a plain read of the same bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import gemv_roofline
from tests.runtime.gguf_files import write_gguf


def test_rows_by_packed_format(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_gguf(tiny_model_path, tmp_path / "tiny-q8_0.gguf", "Q8_0")
    out = tmp_path / "result.json"
    argv = ["gemv_roofline", "--model-path", str(gguf), "--repeat", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    gemv_roofline.main()
    result = json.loads(out.read_text())
    assert result["gguf_types"]["Q8_0"] > 0
    [row] = result["rows"]  # every Q8_0 matrix packs to one format
    assert row["format"] == "8-bit codes, block 32, q8_0" and row["layers"] > 0
    assert 8.0 < row["bits/weight"] < 10.0  # 8-bit codes and a scale per 32
    assert row["GEMV GB/s"] > 0 and row["plain read GB/s"] > 0
    assert row["cpu"] == result["cpu"] and "threads" in row["cpu"]

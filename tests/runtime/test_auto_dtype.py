"""``--dtype auto`` on CPU: a bfloat16 checkpoint stays bfloat16 where the CPU has bfloat16 dot
products (AVX512-BF16), and computes in float32 elsewhere; the flags are injected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import runtime.scheduler.scheduler as scheduler_module
from runtime import Engine
from runtime.model_config import stored_dtype


def test_stored_dtype_reads_either_spelling_and_defaults_to_float32() -> None:
    assert stored_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert stored_dtype({"torch_dtype": "float16"}) == "float16"
    assert stored_dtype({"dtype": "float8_e4m3fn"}) == "float32"
    assert stored_dtype({}) == "float32"


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files, its config saying bfloat16 (the weights are converted at load)."""
    folder = tmp_path_factory.mktemp("bf16-checkpoint")
    for source in tiny_model_path.iterdir():
        if source.name != "config.json":
            (folder / source.name).symlink_to(source)
    config = json.loads((tiny_model_path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return folder


@pytest.mark.parametrize(
    ("flags", "dtype", "kv"),
    [
        ({"avx512f", "avx512_bf16"}, "bfloat16", "bf16"),
        ({"avx512f", "avx512_vnni"}, "float32", "fp32"),
    ],
)
def test_engine_picks_the_dtype_from_the_checkpoint_and_the_cpu(
    bf16_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: set[str],
    dtype: str,
    kv: str,
) -> None:
    monkeypatch.setattr(scheduler_module, "cpu_flags", lambda: frozenset(flags))
    with Engine(bf16_checkpoint, device="cpu", max_total_tokens=512) as engine:
        info = engine.get_server_info()
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
    assert (info["dtype"], info["kv_cache_dtype"]) == (dtype, kv)
    assert len(out["output_ids"]) == 3

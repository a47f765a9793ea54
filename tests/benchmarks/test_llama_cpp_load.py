"""llama.cpp's extra buffer types are turned off only where a probe of the file crashes (the
AMX fault of the 2026-11-26 VM), for llama-cpp-python and llama-server alike."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.suite.systems import llama_cpp_load
from benchmarks.suite.systems.llama_server_process import ServerConfig


@pytest.fixture(autouse=True)
def fresh_probes() -> Iterator[None]:
    llama_cpp_load.extra_buffers_crash.cache_clear()
    yield
    llama_cpp_load.extra_buffers_crash.cache_clear()


def _probe_exits_with(code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, code, "", "boom")
    )


def test_a_probe_killed_by_a_signal_turns_extra_buffers_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _probe_exits_with(-11, monkeypatch)
    assert llama_cpp_load.extra_buffers_crash("/m.gguf")
    assert llama_cpp_load.server_flags("/m.gguf") == ["--no-repack"]


def test_a_probe_that_runs_keeps_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    _probe_exits_with(0, monkeypatch)
    assert llama_cpp_load.server_flags("/m.gguf") == []


def test_a_probe_that_fails_without_crashing_names_the_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _probe_exits_with(1, monkeypatch)
    with pytest.raises(RuntimeError, match="cannot load /m.gguf: boom"):
        llama_cpp_load.extra_buffers_crash("/m.gguf")


def test_without_llama_cpp_python_nothing_is_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed"))
    assert not llama_cpp_load.extra_buffers_crash("/m.gguf")


def test_the_server_gets_the_flags_last() -> None:
    config = ServerConfig(Path("/s"), Path("/m.gguf"), 2, 512, 2, 4321, extra_flags=("-x",))
    assert config.command()[-1] == "-x"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="no llama_cpp")
def test_open_llama_turns_extra_buffers_off_for_that_load_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    seen: list[bool] = []

    def fake_llama(**kwargs: Any) -> str:
        seen.append(bindings.llama_model_default_params().use_extra_bufts)
        return "llm"

    monkeypatch.setattr(llama_cpp, "Llama", fake_llama)
    for crash in (True, False):
        monkeypatch.setattr(llama_cpp_load, "extra_buffers_crash", lambda gguf, c=crash: c)
        assert llama_cpp_load.open_llama("/m.gguf", n_ctx=8) == "llm"
    assert seen == [False, True]
    assert bindings.llama_model_default_params().use_extra_bufts

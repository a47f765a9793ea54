"""Parsing flags, writing DSL programs and serving HTTP do not pay for torch: the heavy parts
load on use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _python(code: str) -> str:
    """The stdout of ``code`` run by a fresh interpreter (nothing imported yet)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(
    "module",
    [
        "runtime.server_args",
        "runtime.sampling_params",
        "runtime.generate_input",
        "frontend_lang",
        "grammar",
        "runtime.server.http_app",  # the server's HTTP process: torch is the scheduler's
        "runtime.server.launcher",
        "runtime.model_config",  # the HTTP process checks the model's config before starting
        "runtime.gguf",  # ... and converts a GGUF file's config and tokenizer
        "runtime.kv_budget",
        "runtime.scheduler",  # its names load their modules on first use
    ],
)
def test_importing_does_not_import_torch(module: str) -> None:
    assert _python(f"import sys, {module}; print('torch' in sys.modules)") == "False"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.runtime.gguf_files import write_gguf

    return write_gguf(tiny_model_path, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("kind", ["folder", "gguf"])
def test_the_tokenizer_processes_load_no_torch(
    kind: str, tiny_model_path: Path, tiny_gguf: Path
) -> None:
    """The HTTP process and the detokenizer read the model's config and load its tokenizer:
    neither imports torch, which took 240 MB in each. (A GGUF file's first conversion, cached
    once per file, runs transformers' converter, which does.)"""
    from runtime.model_files import locate_model

    path = str(tiny_model_path if kind == "folder" else tiny_gguf)
    locate_model(path)  # converted here, as the server's first start does
    code = (
        "import sys; from runtime.model_config import ModelConfig; "
        "from runtime.model_files import load_tokenizer; "
        f"ModelConfig.from_pretrained({path!r}); tokenizer = load_tokenizer({path!r}); "
        "print(tokenizer.encode('hello world'), 'torch' in sys.modules)"
    )
    ids, torch_loaded = _python(code).rsplit(" ", 1)
    assert torch_loaded == "False"
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(locate_model(path).config_dir))
    assert ids == str(auto.encode("hello world"))  # the tokenizer AutoTokenizer loads


def test_the_dsl_loads_the_openai_sdk_on_first_use() -> None:
    """``import frontend_lang`` stays under 0.3 s: the ``openai`` package (about half a second)
    and numpy (the JSON depth check) load only when first used."""
    code = (
        "import sys, frontend_lang as fl; print('openai' in sys.modules, 'numpy' in sys.modules); "
        "print(fl.OpenAI.__module__, 'openai' in sys.modules)"
    )
    assert _python(code).splitlines() == ["False False", "frontend_lang.backends.openai True"]


def test_the_public_names_still_resolve() -> None:
    import runtime

    assert runtime.ServerArgs.__name__ == "ServerArgs"
    assert runtime.Engine.__module__ == "runtime.engine"
    with pytest.raises(AttributeError):
        runtime.NoSuchThing  # noqa: B018


def test_lazy_names_load_their_module_once() -> None:
    code = (
        "import sys, grammar; assert 'grammar.spec' not in sys.modules; "
        "spec = grammar.GrammarSpec; assert 'grammar.spec' in sys.modules; "
        "assert vars(grammar)['GrammarSpec'] is spec; "
        "from grammar import create_backend, xgrammar_backend; "
        "print(sorted(n for n in grammar.__all__ if not hasattr(grammar, n)))"
    )
    assert _python(code) == "[]"  # every public name resolves


@pytest.mark.parametrize(
    "package",
    [
        "runtime",
        "runtime.server",
        "runtime.test_model",
        "runtime.distributed",
        "runtime.dsl_api",
        "radix_cache",
        "frontend_lang",
    ],
)
def test_every_public_name_resolves(package: str) -> None:
    code = f"import {package} as p; print(sorted(n for n in p.__all__ if not hasattr(p, n)))"
    assert _python(code) == "[]"


def test_the_public_names_are_the_imports() -> None:
    """``__all__`` is every name imported (but from ``__future__``, ``typing`` and
    ``lazy_exports``); those under ``if TYPE_CHECKING:`` load on first use, an alias there is
    the exported name."""
    from lazy_exports import exported_names

    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from lazy_exports import lazy_exports\n"
        "from a import b\n"
        "if TYPE_CHECKING:\n"
        "    from m.n import X, Y as Z\n"
        "    import q\n"
    )
    public, lazy = exported_names(source)
    assert public == ["b", "X", "Z"]
    assert lazy == {"X": ("m.n", "X"), "Z": ("m.n", "Y")}

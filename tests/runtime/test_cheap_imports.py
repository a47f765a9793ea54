"""Parsing flags, writing DSL programs and serving HTTP do not pay for torch: the heavy parts
load on use."""

from __future__ import annotations

import subprocess
import sys

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
    ],
)
def test_importing_does_not_import_torch(module: str) -> None:
    assert _python(f"import sys, {module}; print('torch' in sys.modules)") == "False"


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

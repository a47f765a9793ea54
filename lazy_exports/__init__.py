"""The public names of a package's ``__init__`` (or of a module that only re-exports), declared
once: by importing them.

Every name the module imports is public (its ``__all__``), but those from ``__future__``,
``typing`` and this package. A name imported under ``if TYPE_CHECKING:`` (what type checkers
and editors read) comes from a heavy module (torch, xgrammar, the scheduler): at run time its
first access imports that module, so importing the package, or one of its light modules
(``import runtime.server_args``), costs nothing more. This package sits below every other (it
imports none of them), so each of them may use it:
``__all__, __getattr__ = lazy_exports(__name__)``.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NOT_EXPORTED = ("__future__", "typing", "lazy_exports")


def lazy_exports(module: str) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and the module ``__getattr__`` of ``module`` (its ``__name__``), read from
    its source. The first access to a lazy name imports its module and keeps the value, so
    later accesses are plain attribute reads; any other name is an AttributeError (which also
    lets ``from package import submodule`` import the submodule)."""
    public, lazy = exported_names(Path(sys.modules[module].__file__ or "").read_text("utf-8"))

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        source, attribute = lazy[name]
        value = getattr(importlib.import_module(source), attribute)
        setattr(sys.modules[module], name, value)
        return value

    return public, __getattr__


def exported_names(source: str) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """The names the top level of ``source`` imports, and, for each imported under
    ``if TYPE_CHECKING:``, its module and its name there."""
    public: list[str] = []
    lazy: dict[str, tuple[str, str]] = {}
    for statement in ast.parse(source).body:
        in_block = isinstance(statement, ast.If) and ast.unparse(statement.test) == "TYPE_CHECKING"
        for node in statement.body if isinstance(statement, ast.If) and in_block else [statement]:
            if isinstance(node, ast.ImportFrom) and node.module not in _NOT_EXPORTED:
                for alias in node.names:
                    public.append(alias.asname or alias.name)
                    if in_block:
                        lazy[public[-1]] = (str(node.module), alias.name)
    return public, lazy

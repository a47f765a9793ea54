"""Public names that load on first use, for package ``__init__``s.

A package whose public names come from heavy modules (torch, xgrammar, the scheduler) declares
each such name once, as an import under ``if TYPE_CHECKING:`` in its ``__init__`` (what type
checkers and editors read), and sets ``__getattr__ = lazy_exports(__name__)``: at run time the
first access to a name imports the module that block names for it. Importing the package, or
one of its light modules (``import runtime.server_args``), so costs nothing more. This module
sits below every package (it imports none of them), so each of them may use it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def lazy_exports(package: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` (its ``__name__``). The first access to a name
    imported under the module's ``if TYPE_CHECKING:`` imports its module and keeps the value in
    the package, so later accesses are plain attribute reads; any other name is an
    AttributeError (which also lets ``from package import submodule`` import the submodule).
    """

    @functools.cache
    def where() -> dict[str, tuple[str, str]]:
        source = Path(sys.modules[package].__file__ or "").read_text(encoding="utf-8")
        return _type_checking_imports(ast.parse(source))

    def __getattr__(name: str) -> Any:
        if name not in where():
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = where()[name]
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def _type_checking_imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Each name a top-level ``if TYPE_CHECKING:`` block imports: its module and its name there."""
    where = {}
    for block in tree.body:
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING":
            for statement in block.body:
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    for alias in statement.names:
                        where[alias.asname or alias.name] = (statement.module, alias.name)
    return where

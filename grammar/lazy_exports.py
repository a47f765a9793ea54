"""Public names that load on first use, for package ``__init__``s.

A package whose public names come from heavy modules (torch, xgrammar, the scheduler) exports
them through ``lazy_exports``, so that importing the package, or one of its light modules
(``import runtime.server_args``, ``import grammar.tool_call_formats``), costs nothing more.
It lives here, in the lowest package that needs it, because ``grammar`` imports nothing from
``runtime`` while ``runtime`` may use ``grammar``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` (its ``__name__``): ``where`` maps each lazy
    name to the module defining it. The first access imports that module and keeps the value
    in the package, so later accesses are plain attribute reads; any other name is an
    AttributeError (which also lets ``from package import submodule`` import the submodule).
    """

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__

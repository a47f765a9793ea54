"""What the DSL (``frontend_lang``) may use of the runtime: the one module of ``runtime`` it
imports, an import-linter contract in pyproject.toml holds it to that. Everything else in
``runtime`` may change without the DSL noticing.

- ``Engine`` and ``SchedulerDied``: the in-process engine behind ``fl.Engine`` (loaded on first
  use, it imports torch);
- the choice scoring ``select`` shares with the compiled executor (``program.select_math``);
- the chat template's role blocks (``role_blocks``) and the cache-salt check
  (``request_checks``), and the JSON formats a constraint may ask for (``JSON_FORMATS``), so
  the DSL refuses what the server would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grammar.options import JSON_FORMATS
from lazy_exports import lazy_exports
from runtime.errors import SchedulerDied
from runtime.program.select_math import (
    CHOICES_METHODS,
    GREEDY_TOKEN,
    HEAL_WINDOW,
    TOKEN_LENGTH_NORMALIZED,
    UNCONDITIONAL_LIKELIHOOD_NORMALIZED,
    heal_boundary,
    pick,
)
from runtime.request_checks import check_cache_salt
from runtime.role_blocks import ChatTemplateError, derive_role_blocks

if TYPE_CHECKING:
    from runtime.engine import Engine

__all__, __getattr__ = lazy_exports(__name__)

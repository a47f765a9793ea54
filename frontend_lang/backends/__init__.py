"""Backends: where a program's calls go. Engine (in-process), RuntimeEndpoint (``arbor serve``
over HTTP), OpenAI (any OpenAI-compatible server; it loads on first use, as the ``openai``
package takes longer to import than all the rest of the DSL)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frontend_lang.backends.base import Backend, BackendError
from frontend_lang.backends.engine import Engine
from frontend_lang.backends.runtime_endpoint import RuntimeEndpoint
from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from frontend_lang.backends.openai import OpenAI

__all__, __getattr__ = lazy_exports(__name__)

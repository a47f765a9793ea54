"""Backends: where a program's calls go. Engine (in-process), RuntimeEndpoint (``arbor serve``
over HTTP), OpenAI (any OpenAI-compatible server)."""

from frontend_lang.backends.base import Backend, BackendError
from frontend_lang.backends.engine import Engine
from frontend_lang.backends.openai import OpenAI
from frontend_lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "Engine", "OpenAI", "RuntimeEndpoint"]

"""The one place that picks an implementation for each op: triton on CUDA, native C++ on CPU.

Implementations register under ``(op, backend)``. ``set_kernel_backend`` forces a backend
("torch", "triton" or "native"); "auto" picks triton for CUDA tensors when triton has the op
and imports, the native C++ extension (``kernels.cpu_native``) for CPU tensors when it is built
and has the op, and the torch reference otherwise. A missing triton or native build never breaks
the CPU path: "auto" warns once and runs the reference. The ARBOR_KERNEL_BACKEND environment
variable, read at import, sets the starting choice.

Implementations registered with ``graph_safe=True`` promise to be capturable in a CUDA graph:
no host sync (no ``.item()``, ``.tolist()``, ``.cpu()``, no Python branching on tensor values)
and launch shapes that depend only on tensor shapes, so a replay with new values in the same
buffers computes the right thing. ``graph_safe`` asks that of whatever ``resolve`` picks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton", "native")
_impls: dict[str, dict[str, Callable[..., Any]]] = {}
_graph_safe: set[tuple[str, str]] = set()  # (op, backend) pairs registered as graph-safe
_forced = os.environ.get("ARBOR_KERNEL_BACKEND", "auto")
if _forced not in BACKENDS:
    raise ValueError(
        f"ARBOR_KERNEL_BACKEND={_forced!r} is not a kernel backend; "
        f"use one of {', '.join(BACKENDS)}"
    )
Op = TypeVar("Op", bound=Callable[..., Any])
_triton_state: dict[str, Any] = {"loaded": False, "error": None}
_native_state: dict[str, Any] = {"loaded": False, "error": None}


def register(
    op: str, backend: str, graph_safe: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the ``backend`` implementation of ``op``; ``graph_safe`` records
    that it may run inside a captured CUDA graph (see the module docstring)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _impls.setdefault(op, {})[backend] = fn
        if graph_safe:
            _graph_safe.add((op, backend))
        return fn

    return wrap


def dispatched(reference: Op) -> Op:
    """The op that ``reference`` (its torch implementation, registered) declares: the same
    name, signature and docstring, running the implementation ``resolve`` picks for the device
    of its first argument. Every implementation is called with all arguments, positionally."""
    name, signature = reference.__name__, inspect.signature(reference)
    arity = len(signature.parameters)

    @functools.wraps(reference)
    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) < arity:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        return resolve(name, args[0].device)(*args)

    return cast(Op, run)


def set_kernel_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    global _forced
    _forced = name
    if name == "triton":
        _load_triton(required=True)
    if name == "native":
        _load_native(required=True)


def kernel_backend() -> str:
    return _forced


def resolve(op: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``op`` for tensors on ``device`` under the current backend choice."""
    want_triton = _forced == "triton" or (_forced == "auto" and device.type == "cuda")
    if want_triton and _load_triton(required=_forced == "triton"):
        impl = _impls[op].get("triton")
        if impl is not None:
            return impl
    want_native = device.type == "cpu" and _forced in ("auto", "native")
    if want_native and _load_native(required=_forced == "native"):
        impl = _impls[op].get("native")
        if impl is not None:
            return impl
    return _impls[op]["torch"]


def graph_safe(op: str, device: torch.device) -> bool:
    """Whether the implementation ``resolve(op, device)`` picks now is registered graph-safe."""
    impl = resolve(op, device)
    return any(fn is impl and (op, backend) in _graph_safe for backend, fn in _impls[op].items())


def native_available() -> bool:
    """Whether the native CPU kernels are built and loaded (loading them on first ask)."""
    return _load_native(required=False)


def _load_triton(required: bool) -> bool:
    """Import the triton implementations once; report failure instead of raising unless required."""
    if not _triton_state["loaded"]:
        _triton_state["loaded"] = True
        try:
            importlib.import_module("kernels.triton_ops")
        except Exception as exc:  # triton missing or broken: the torch path must keep working
            _triton_state["error"] = exc
            logger.warning("triton kernels unavailable, using the torch reference: %s", exc)
    if _triton_state["error"] is not None and required:
        raise RuntimeError(
            f"kernel backend 'triton' requested but unavailable: {_triton_state['error']}"
        )
    return _triton_state["error"] is None


def _load_native(required: bool) -> bool:
    """Load the native CPU extension once; like ``_load_triton`` for failures."""
    if not _native_state["loaded"]:
        _native_state["loaded"] = True
        try:
            ops = importlib.import_module("kernels.cpu_native.ops")
            if not ops.available():
                from kernels import cpu_native

                _native_state["error"] = cpu_native.load_error()
        except Exception as exc:
            _native_state["error"] = exc
            logger.warning("native CPU kernels unavailable, using the torch reference: %s", exc)
    if _native_state["error"] is not None and required:
        raise RuntimeError(
            f"kernel backend 'native' requested but unavailable: {_native_state['error']}"
        )
    return _native_state["error"] is None

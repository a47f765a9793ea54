"""The one place that picks an implementation for each op: triton on CUDA, native C++ on CPU.

Implementations register under ``(op, backend)``. ``set_kernel_backend`` forces a backend
("torch", "triton" or "native"); "auto" picks triton for CUDA tensors when triton has the op
and imports, the native C++ extension (``kernels.cpu_native``) for CPU tensors when it is built
and has the op, and the torch reference otherwise. A missing triton or native build never breaks
the CPU path: "auto" warns once and runs the reference. The ARBOR_KERNEL_BACKEND environment
variable, read at import, sets the starting choice.

``set_deterministic`` turns on deterministic mode for the process (``--deterministic``): the
native CPU kernels then sum in one fixed order, so that a token's result does not depend on
the batch it runs in, on how its prompt was chunked, or on whether its prefix came from the
cache (kernels/cpu_native/common.h); float projections go through ``fixed_order_linear``.

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
_MODULES = {"triton": "arbor_kernels.triton_ops", "native": "arbor_kernels.cpu_native.ops"}
_NAMES = {"triton": "triton kernels", "native": "native CPU kernels"}
_load_errors: dict[str, BaseException | None] = {}  # per backend tried: why it did not load
# (op, device type) -> what ``resolve`` picked: a decode step of a deep model calls ops a few
# hundred times, and picking anew each time was a measurable part of its host overhead.
# Emptied whenever the choice could change (a registration, a forced backend).
_resolved: dict[tuple[str, str], Callable[..., Any]] = {}
_deterministic = False


def register(
    op: str, backend: str, graph_safe: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the ``backend`` implementation of ``op``; ``graph_safe`` records
    that it may run inside a captured CUDA graph (see the module docstring)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _impls.setdefault(op, {})[backend] = fn
        _resolved.clear()
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
    # Trailing defaults are appended without binding: a call that leaves them out (most calls
    # of an op that grew an option) costs no more than one that passes them all.
    defaults = [p.default for p in signature.parameters.values()]
    required = arity
    while required > 0 and defaults[required - 1] is not inspect.Parameter.empty:
        required -= 1
    tails = [tuple(defaults[n:]) for n in range(arity + 1)]  # the defaults after n arguments

    @functools.wraps(reference)
    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) < required:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        elif len(args) < arity:
            args += tails[len(args)]
        device = args[0].device
        impl = _resolved.get((name, device.type))
        if impl is None:
            impl = _resolved[name, device.type] = resolve(name, device)
        return impl(*args)

    return cast(Op, run)


def set_kernel_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    global _forced
    _forced = name
    _resolved.clear()
    if name in _MODULES:
        _load(name, required=True)


def kernel_backend() -> str:
    return _forced


def set_deterministic(on: bool) -> None:
    """Deterministic mode on or off for the whole process (module docstring); the native
    kernels, when they load later, start in it."""
    global _deterministic
    _deterministic = on
    if "native" in _load_errors and _load_errors["native"] is None:
        importlib.import_module(_MODULES["native"]).ext.set_deterministic(on)


def deterministic() -> bool:
    """Whether deterministic mode is on (``set_deterministic``)."""
    return _deterministic


def resolve(op: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``op`` for tensors on ``device`` under the current backend choice."""
    want_triton = _forced == "triton" or (_forced == "auto" and device.type == "cuda")
    if want_triton and _load("triton", required=_forced == "triton"):
        impl = _impls[op].get("triton")
        if impl is not None:
            return impl
    want_native = device.type == "cpu" and _forced in ("auto", "native")
    if want_native and _load("native", required=_forced == "native"):
        impl = _impls[op].get("native")
        if impl is not None:
            return impl
    return _impls[op]["torch"]


def graph_safe(op: str, device: torch.device) -> bool:
    """Whether the implementation ``resolve(op, device)`` picks now is registered graph-safe."""
    impl = resolve(op, device)
    return any(fn is impl and (op, backend) in _graph_safe for backend, fn in _impls[op].items())


def runs_natively(op: str, device: torch.device) -> bool:
    """Whether ``op`` on ``device`` runs a native or triton kernel now, not its torch reference."""
    return resolve(op, device) is not _impls[op]["torch"]


def native_available() -> bool:
    """Whether the native CPU kernels are built and loaded (loading them on first ask)."""
    return _load("native", required=False)


def _load(backend: str, required: bool) -> bool:
    """Import ``backend``'s implementations once; report failure instead of raising unless
    required (a missing or broken triton or native build must leave the torch path working)."""
    if backend not in _load_errors:
        _load_errors[backend] = None
        try:
            module = importlib.import_module(_MODULES[backend])
            # A native build that did not load warned already; its module says why.
            _load_errors[backend] = getattr(module, "load_error", lambda: None)()
        except Exception as exc:
            _load_errors[backend] = exc
            logger.warning("%s unavailable, using the torch reference: %s", _NAMES[backend], exc)
    error = _load_errors[backend]
    if error is not None and required:
        raise RuntimeError(f"kernel backend {backend!r} requested but unavailable: {error}")
    return error is None

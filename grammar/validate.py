"""Validate-and-retry's check: does a finished output satisfy the schema it was asked for?

Where a schema keyword has no exact automaton (``not``, general ``uniqueItems``, ``contains``
counts, formats without one, ...), ``strict_mode: "validate"`` compiles the enforceable part
(best effort: a superset of the schema's language) and checks each finished output here, with
the ``jsonschema`` validator of the schema's own draft, formats asserted; the runtime draws
again until one passes or its attempts run out, so an output that breaks the schema is never
returned as valid.

Two departures from a plain ``jsonschema`` validator:

- ``multipleOf`` is decided on the decimal values as written, as the specification defines it:
  ``0.07`` is a multiple of ``0.01``. Python's validator divides binary floats (0.07 / 0.01 =
  7.000000000000001) and rejects a third of the true multiples of 0.1; grammars of ours
  (``schema_numbers``) write exactly the decimal multiples.
- A check can take exponential time on the output (a ``pattern`` that backtracks
  catastrophically, such as ``^(a+)+b`` against forty ``a``\\ s, inside a ``not`` or an
  ``anyOf`` branch), and Python's ``re`` cannot be interrupted. ``ValidationPool`` runs checks
  in worker processes killed past a deadline; the request then fails with
  ``ValidationTimeout``, and no tokenizer thread is held.

The module imports nothing of the package at its top: the workers load it alone (without
``grammar/__init__``, which imports xgrammar and torch), so they start in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from referencing.exceptions import Unresolvable

# A reason longer than this is cut: it ends in an error message, not a report.
_MAX_REASON = 300
# Validators a worker keeps, by schema text (retries of one request check the same schema).
_CACHED_SCHEMAS = 16
# A worker loads this file as a module of its own, then serves checks.
_WORKER_CODE = (
    "import importlib.util as u, sys; "
    "s = u.spec_from_file_location('arbor_output_check', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.worker_main()"
)


class ValidationTimeout(Exception):
    """Checking one output took longer than the pool's deadline."""


def validator_class(schema: Any) -> Any:
    """The ``jsonschema`` validator class of ``schema``'s draft (2020-12 when it declares
    none), with ``multipleOf`` decided on exact decimals."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return jsonschema.validators.extend(cls, {"multipleOf": _decimal_multiple_of})


def _decimal_multiple_of(validator: Any, step: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "number"):
        return
    quotient = _exact(instance) / _exact(step)
    if quotient.denominator != 1:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {step!r}")


def _exact(number: int | float) -> Fraction:
    """The decimal value a JSON number was written as (its shortest repr, for a float)."""
    return Fraction(repr(number)) if isinstance(number, float) else Fraction(number)


def output_validator(schema: dict[str, Any] | str) -> Callable[[str], str | None]:
    """A check of an output's text against ``schema`` (a dict or its JSON text): None when
    the text is one JSON value that validates, else the reason, naming the JSON pointer of
    the first failing value. Raises ValueError for a schema that is not valid JSON; the check
    raises ValueError when the validator cannot evaluate the schema for this value (a
    reference it cannot resolve, such as a ``$dynamicRef`` to an anchor it lacks). The check
    runs in the calling thread, unbounded: see ``ValidationPool``."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    cls = validator_class(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"the output is not one JSON value ({exc})"
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        except (jsonschema.exceptions.SchemaError, Unresolvable, LookupError, ValueError) as exc:
            raise ValueError(f"the schema cannot be checked: {exc}") from None
        if error is None:
            return None
        pointer = "".join(f"/{part}" for part in error.absolute_path) or "/"
        reason = f"the value at {pointer} breaks '{error.validator}': {error.message}"
        return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."

    return check


class ValidationPool:
    """``output_validator`` checks in up to ``workers`` processes (started on first use), each
    killed when one check overruns ``timeout`` seconds."""

    def __init__(self, workers: int = 2, timeout: float = 5.0) -> None:
        if workers < 1 or timeout <= 0:
            raise ValueError("workers must be >= 1 and timeout > 0")
        self.timeout = timeout
        self._workers = workers
        self._idle: list[Any] = []
        self._started = 0
        self._closed = False
        self._lock = threading.Condition()

    def check(self, schema: str, text: str) -> str | None:
        """What ``output_validator(schema)(text)`` returns, computed in a worker; blocks.
        Raises ValidationTimeout past the deadline (the worker is killed), ValueError when the
        schema cannot be checked (or the worker died)."""
        from grammar.sandbox import WorkerDied, WorkerOverrun

        worker = self._acquire()
        keep = False
        try:
            status, payload = worker.run((schema, text), self.timeout)
        except WorkerOverrun:
            raise ValidationTimeout(
                f"checking an output against the schema took over {self.timeout:g} s (a pattern "
                "that backtracks catastrophically?); simplify its patterns"
            ) from None
        except WorkerDied:
            raise ValueError("the schema cannot be checked: the checking process died") from None
        else:
            keep = True
        finally:
            self._release(worker, keep)
        if status == "error":
            raise ValueError(payload)
        return payload  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Kill the idle workers; busy ones are killed when their check returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._lock.notify_all()
        for worker in idle:
            worker.kill()

    def _acquire(self) -> Any:
        from grammar.sandbox import WorkerProcess

        with self._lock:
            while True:
                if self._closed:
                    raise ValueError("the server is shutting down")
                if self._idle:
                    return self._idle.pop()
                if self._started < self._workers:
                    self._started += 1
                    break
                self._lock.wait()
        try:
            return WorkerProcess([_WORKER_CODE, str(Path(__file__).resolve())], None)
        except Exception:
            with self._lock:
                self._started -= 1
                self._lock.notify()
            raise ValueError("the output checker failed to start; see the server log") from None

    def _release(self, worker: Any, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed:
                self._idle.append(worker)
            else:
                self._started -= 1
            self._lock.notify()
        if not keep or self._closed:
            worker.kill()


def worker_main() -> None:
    """A worker's life: answer ("ok", reason or None) or ("error", message) per (schema text,
    output text) until the serving process closes the pipe. Messages go over fd 0 and a copy
    of fd 1; fd 1 itself then points at stderr, so nothing printed can corrupt them."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process decides when to stop
    inbox = Connection(0, writable=False)
    conn = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    try:
        inbox.recv()  # the start message (nothing to set up)
    except (EOFError, OSError):
        return
    conn.send(("ready", None))
    checks: OrderedDict[str, Callable[[str], str | None]] = OrderedDict()
    while True:
        try:
            schema, text = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            if schema not in checks:
                checks[schema] = output_validator(schema)
                if len(checks) > _CACHED_SCHEMAS:
                    checks.popitem(last=False)
            checks.move_to_end(schema)
            reply: tuple[str, Any] = ("ok", checks[schema](text))
        except (ValueError, RecursionError) as exc:
            reply = ("error", str(exc) or type(exc).__name__)
        conn.send(reply)

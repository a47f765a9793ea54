"""Gives expressions their meaning: what each one appends to a state and asks of the backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from frontend_lang.errors import ProgramError
from frontend_lang.ir import Expr, Gen, Role, RoleBegin, RoleEnd, Select, Seq, Text
from frontend_lang.scoring import run_select

if TYPE_CHECKING:
    from frontend_lang.state import ProgramState


def execute(state: ProgramState, expr: Expr) -> None:
    """Apply ``expr`` to ``state`` on the calling thread. A failing backend call raises
    ProgramError naming the program and the variable; misuse (a role block left open, an
    unknown expression) raises ValueError/TypeError."""
    if isinstance(expr, Text):
        state.append_text(expr.text)
    elif isinstance(expr, Seq):
        for part in expr.parts:
            execute(state, part)
    elif isinstance(expr, Gen):
        _gen(state, expr)
    elif isinstance(expr, Select):
        _select(state, expr)
    elif isinstance(expr, Role):
        _guarded(state, None, lambda: state.begin_role(expr.role))
        if expr.content is not None:
            execute(state, expr.content)
        state.end_role(expr.role)
    elif isinstance(expr, RoleBegin):
        _guarded(state, None, lambda: state.begin_role(expr.role))
    elif isinstance(expr, RoleEnd):
        state.end_role(expr.role)
    else:
        raise TypeError(f"unknown expression {expr!r}")


def _gen(state: ProgramState, expr: Gen) -> None:
    def call() -> None:
        on_delta = None
        if state.streaming:

            def on_delta(piece: str) -> None:
                state.emit_text(piece, expr.name)

        output = state.backend.generate(state.prompt(), expr.sampling_params(), on_delta)
        try:
            value = expr.parse(output.text)
        except ValueError as exc:
            reason = output.finish_type or "?"
            raise ValueError(
                f"the output {output.text[:200]!r} does not parse ({exc}); it finished by "
                f"{reason}: raise max_tokens if it was cut short"
            ) from exc
        state.append_text(output.text, expr.name, emit=not state.streaming)
        if expr.name is not None:
            shown = value if expr.dtype is not None else output.text
            state.set_var(expr.name, shown, {**output.meta, "text": output.text}, value)

    _guarded(state, expr.name, call)


def _select(state: ProgramState, expr: Select) -> None:
    def call() -> None:
        result = run_select(state.backend, state.prompt(), expr)
        state.append_text(result.choice, expr.name)
        if expr.name is not None:
            state.set_var(expr.name, result.choice, result.meta, result.choice)

    _guarded(state, expr.name, call)


def _guarded(state: ProgramState, variable: str | None, call: Callable[[], None]) -> None:
    """Run ``call``; any failure becomes a ProgramError naming the program and ``variable``."""
    try:
        call()
    except ProgramError:
        raise
    except Exception as exc:
        raise ProgramError(state.program, variable, exc) from exc

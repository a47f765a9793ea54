"""The exception a program's caller sees when a call inside the program fails."""

from __future__ import annotations


class ProgramError(RuntimeError):
    """A call inside program ``program`` failed; ``variable`` is what it was generating (None
    for calls that set no variable, such as a fork's prefill). ``__cause__`` is the original."""

    def __init__(self, program: str, variable: str | None, cause: BaseException) -> None:
        where = f"while generating {variable!r}" if variable else "while running"
        super().__init__(f"program {program!r} failed {where}: {type(cause).__name__}: {cause}")
        self.program = program
        self.variable = variable

"""``ForkGroup``: the branches of ``s.fork(n)`` and their join."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from frontend_lang.ir import Expr

if TYPE_CHECKING:
    from frontend_lang.state import ProgramState


class ForkGroup:
    """The branches of ``s.fork(n)``: index or iterate them; ``forks += expr`` appends to all;
    ``join()`` waits for all and sets each variable they assigned in the parent to the list of
    the branches' values (in branch order)."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState]) -> None:
        self.parent = parent
        self.branches = branches

    def __len__(self) -> int:
        return len(self.branches)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.branches)

    def __getitem__(self, index: int) -> ProgramState:
        return self.branches[index]

    def __setitem__(self, index: int, state: ProgramState) -> None:
        if state is not self.branches[index]:  # ``forks[i] += expr`` assigns the branch back
            raise TypeError("fork branches cannot be replaced")

    def __iadd__(self, other: Expr | str) -> ForkGroup:
        for branch in self.branches:
            branch += other
        return self

    def join(self) -> None:
        for branch in self.branches:
            branch.sync()
        names: list[str] = []
        for branch in self.branches:
            names.extend(n for n in branch.assigned if n not in names)
        parent = self.parent

        def gather() -> None:
            for name in names:
                values, metas, parsed = zip(*(b.entry(name) for b in self.branches), strict=True)
                parent.set_var(name, list(values), list(metas), list(parsed))

        parent.submit(gather)

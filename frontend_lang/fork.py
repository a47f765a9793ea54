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

    def __init__(
        self, parent: ProgramState, branches: list[ProgramState], fork_id: int | None = None
    ) -> None:
        self.parent = parent
        self.branches = branches
        self.fork_id = fork_id  # a compiled run's name for the fork

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
        compiled = self.parent._run.compiled
        if compiled is not None:  # recorded: joined when the parent's segment runs
            from frontend_lang.compiled import JoinRecord

            compiled.record(self.parent, JoinRecord(self))
            return
        for branch in self.branches:
            branch.sync()
        self.parent.submit(self._gather)

    def _gather_now(self) -> None:
        """Wait for the branches and set their variables in the parent, on the parent's
        thread (a compiled run's replay of the join)."""
        for branch in self.branches:
            branch.sync()
        self._gather()

    def _gather(self) -> None:
        names: list[str] = []
        for branch in self.branches:
            names.extend(n for n in branch.assigned if n not in names)
        for name in names:
            values, metas, parsed = zip(*(b.entry(name) for b in self.branches), strict=True)
            self.parent.set_var(name, list(values), list(metas), list(parsed))

"""tree-of-thought: a fork-heavy DSL program (a tree of reasoning steps judged by select)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import frontend_lang as fl
from benchmarks.suite.systems.arbor_programs import run_programs
from benchmarks.suite.trace import SystemRun
from benchmarks.suite.workloads.base import Workload
from benchmarks.suite.workloads.text import paragraph
from runtime import Engine


def expand(
    state: fl.ProgramState, width: int, depth: int, max_tokens: int, label: str
) -> list[fl.ProgramState]:
    """Fork ``width`` branches, each generating one step; recurse ``depth`` levels. Returns
    the leaf branches (``width ** depth`` of them)."""
    forks = state.fork(width)
    for i, branch in enumerate(forks):
        branch += f"Step {label}{i + 1}: "
        branch += fl.gen("step", max_tokens=max_tokens, temperature=0.0) + "\n"
    if depth == 1:
        return list(forks)
    return [
        leaf
        for i, branch in enumerate(forks)
        for leaf in expand(branch, width, depth - 1, max_tokens, f"{label}{i + 1}.")
    ]


@fl.function
def tree_of_thought(
    s: fl.ProgramState, problem: str, width: int, depth: int, max_tokens: int
) -> None:
    s += fl.system("You solve problems by exploring several lines of reasoning.")
    s += fl.user(problem)
    with s.assistant():
        s += "Let me explore a few lines of reasoning.\n"
        leaves = expand(s, width, depth, max_tokens, "")
        for leaf in leaves:
            leaf += "Is this line sound? " + fl.select("sound", choices=["yes", "no"])
        margins = [
            leaf.get_meta_info("sound")["scores"][0] - leaf.get_meta_info("sound")["scores"][1]
            for leaf in leaves
        ]
        best = max(range(len(leaves)), key=margins.__getitem__)
        s += f"The most promising line is number {best + 1}.\nSo the answer is "
        s += fl.gen("answer", max_tokens=max_tokens, temperature=0.0)


@dataclass(frozen=True)
class TreeOfThought(Workload):
    """``problems`` programs: each forks ``width`` ways ``depth`` levels deep (a gen per
    branch), judges every leaf with ``select``, then generates an answer (greedy gens of
    ``max_tokens`` tokens unless EOS comes first)."""

    name = "tree-of-thought"
    summary = "fork-heavy DSL program: a tree of steps, each leaf judged by select"
    count_field = "problems"

    problems: int = 16
    width: int = 3
    depth: int = 2
    max_tokens: int = 32

    @classmethod
    def preset(cls, quick: bool) -> TreeOfThought:
        return cls(problems=4, width=2, max_tokens=16) if quick else cls()

    def arguments(self) -> list[dict[str, object]]:
        rng = random.Random(self.seed)
        return [
            {
                "problem": paragraph(rng, 3),
                "width": self.width,
                "depth": self.depth,
                "max_tokens": self.max_tokens,
            }
            for _ in range(self.problems)
        ]

    def run_arbor(self, engine: Engine) -> SystemRun:
        return run_programs(engine, tree_of_thought, self.arguments())

    def run_arbor_compiled(self, engine: Engine) -> SystemRun:
        return run_programs(engine, tree_of_thought, self.arguments(), compiled=True)

"""The benchmark workloads, by name."""

import dataclasses

from benchmarks.suite.workloads.agent import Agent
from benchmarks.suite.workloads.base import Workload
from benchmarks.suite.workloads.few_shot import FewShot
from benchmarks.suite.workloads.json_extraction import JsonExtraction
from benchmarks.suite.workloads.multi_turn import MultiTurn
from benchmarks.suite.workloads.random_lengths import RandomLengths
from benchmarks.suite.workloads.tree_of_thought import TreeOfThought

WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (FewShot, MultiTurn, TreeOfThought, Agent, JsonExtraction, RandomLengths)
}


def create_workload(name: str, quick: bool, count: int | None = None, seed: int = 0) -> Workload:
    """The named workload at its default (or ``quick``) size; ``count`` overrides its request
    count (questions, sessions, ...)."""
    workload = WORKLOADS[name].preset(quick)
    if count is not None:
        workload = workload.with_count(count)
    return dataclasses.replace(workload, seed=seed)


__all__ = [
    "WORKLOADS",
    "Agent",
    "FewShot",
    "JsonExtraction",
    "MultiTurn",
    "RandomLengths",
    "TreeOfThought",
    "Workload",
    "create_workload",
]

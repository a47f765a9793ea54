"""The benchmark workloads, by name."""

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

__all__ = [
    "WORKLOADS",
    "Agent",
    "FewShot",
    "JsonExtraction",
    "MultiTurn",
    "RandomLengths",
    "TreeOfThought",
    "Workload",
]

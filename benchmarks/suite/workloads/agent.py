"""agent: a ReAct-style DSL loop that thinks, picks a tool with select and calls it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import frontend_lang as fl
from benchmarks.suite.systems.arbor_programs import run_programs
from benchmarks.suite.trace import SystemRun
from benchmarks.suite.workloads.base import Workload
from benchmarks.suite.workloads.text import paragraph
from examples.react_agent import calculator  # one calculator for the example and the bench
from runtime import Engine

FACTS = {
    "paris": "Paris is the capital of France; about 2.1 million people live there.",
    "tokyo": "Tokyo is the capital of Japan; about 14 million people live there.",
    "lima": "Lima is the capital of Peru; about 10 million people live there.",
    "oslo": "Oslo is the capital of Norway; about 0.7 million people live there.",
}


def lookup(city: str) -> str:
    return FACTS.get(city.strip().lower(), f"no entry for {city!r}")


# Each tool's input is constrained to what the tool accepts.
TOOLS: dict[str, tuple[Callable[[str], str], str]] = {
    "calculator": (calculator, r"[1-9][0-9]{0,3}( [-+*/] [1-9][0-9]{0,3}){1,2}"),
    "lookup": (lookup, "(" + "|".join(FACTS) + ")"),
}


@fl.function
def react_agent(
    s: fl.ProgramState, question: str, max_steps: int, min_steps: int, max_tokens: int
) -> None:
    s += fl.system(
        "Answer by reasoning step by step. After each thought choose an action: calculator "
        "(arithmetic), lookup (facts about a city) or finish (give the answer)."
    )
    s += fl.user(question)
    with s.assistant():
        for step in range(max_steps):
            s += "Thought: " + fl.gen(f"thought_{step}", max_tokens=max_tokens, temperature=0.0)
            choices = [*TOOLS, "finish"] if step >= min_steps else list(TOOLS)
            s += "\nAction: " + fl.select(f"action_{step}", choices=choices)
            action = s[f"action_{step}"]
            if action == "finish":
                s += "\nAnswer: " + fl.gen("answer", max_tokens=max_tokens, temperature=0.0)
                return
            tool, pattern = TOOLS[action]
            s += "\nInput: " + fl.gen(
                f"input_{step}", max_tokens=16, regex=pattern, temperature=0.0
            )
            s += f"\nObservation: {tool(s[f'input_{step}'])}\n"


NOTE = "tool inputs constrained by regex"


@dataclass(frozen=True)
class Agent(Workload):
    """``tasks`` ReAct programs of ``min_steps``..``max_steps`` steps: a greedy thought of
    ``max_tokens`` tokens, a ``select`` over the tools (finish allowed from ``min_steps``), a
    regex-constrained tool input, and the tool's output appended as the observation."""

    name = "agent"
    summary = "ReAct loop: gen thought, select a tool, constrained tool input, observation"
    count_field = "tasks"

    tasks: int = 32
    max_steps: int = 4
    min_steps: int = 2
    max_tokens: int = 32

    @classmethod
    def preset(cls, quick: bool) -> Agent:
        return cls(tasks=6, max_steps=3, min_steps=1, max_tokens=16) if quick else cls()

    def arguments(self) -> list[dict[str, object]]:
        rng = random.Random(self.seed)
        return [
            {
                "question": paragraph(rng, 2)
                + " How many people live in "
                + rng.choice(list(FACTS)).title()
                + "?",
                "max_steps": self.max_steps,
                "min_steps": self.min_steps,
                "max_tokens": self.max_tokens,
            }
            for _ in range(self.tasks)
        ]

    def run_arbor(self, engine: Engine) -> SystemRun:
        return run_programs(engine, react_agent, self.arguments(), NOTE)

    def run_arbor_compiled(self, engine: Engine) -> SystemRun:
        return run_programs(engine, react_agent, self.arguments(), NOTE, compiled=True)

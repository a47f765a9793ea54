"""The workload interface: a named, seeded, sized recipe that Arbor runs first."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from benchmarks.suite.systems.arbor import Request, run_requests
from benchmarks.suite.trace import SystemRun
from runtime import Engine


@dataclass(frozen=True)
class Workload(ABC):
    """A benchmark workload. Fields are its sizes; ``count_field`` names the one that
    ``--requests`` sets (questions, sessions, programs, ...). ``run_arbor`` runs it on an
    Engine and returns the traced calls, which baselines replay."""

    name: ClassVar[str]
    summary: ClassVar[str]
    count_field: ClassVar[str]

    seed: int = 0

    @classmethod
    @abstractmethod
    def preset(cls, quick: bool) -> Workload:
        """The default sizes, or with ``quick`` sizes that run in well under a minute."""

    def with_count(self, count: int) -> Workload:
        return dataclasses.replace(self, **{self.count_field: count})  # type: ignore[arg-type]

    @abstractmethod
    def run_arbor(self, engine: Engine) -> SystemRun:
        """Run on ``engine`` (cache flushed first) and trace every call in sending order."""

    def run_arbor_compiled(self, engine: Engine) -> SystemRun | None:
        """A DSL-program workload run with compiled execution (the ``arbor-compiled`` row);
        None for a workload that is not a DSL program."""
        return None

    def describe(self) -> dict[str, object]:
        """The sizes, for the JSON result."""
        return {"workload": self.name, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class RequestListWorkload(Workload):
    """A workload whose requests are all known up front and independent: offline, every
    request is sent at t=0; online (``arbor bench serve``), they arrive as a Poisson process."""

    note: ClassVar[str] = ""

    @abstractmethod
    def requests(self, tokenizer: Any) -> list[Request]:
        """The requests, built with the model's tokenizer (seeded: the same on every call)."""

    def run_arbor(self, engine: Engine) -> SystemRun:
        return run_requests(engine, self.requests(engine.tokenizer), self.note)

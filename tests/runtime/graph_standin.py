"""Graph factories for tests: an eager stand-in for CUDA graphs, so the graph runner's path runs
on a CPU-only machine, and a wrapper that counts captures and replays of any factory."""

from __future__ import annotations

from collections.abc import Callable

from runtime.cuda_graph_runner import CapturedGraph, GraphFactory


class EagerGraph:
    """Capturing runs the callable once, as CUDA capture records it; ``replay`` runs it again,
    reading whatever the static buffers hold now, which is what a CUDA graph replay does."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        run()

    def replay(self) -> None:
        self.run()


class CountingGraphFactory:
    """A ``GraphFactory`` capturing with ``capture`` (default: ``EagerGraph``) that counts
    what it captured and how many replays ran."""

    def __init__(self, capture: GraphFactory = EagerGraph) -> None:
        self.capture = capture
        self.captured = 0
        self.replays = 0

    def __call__(self, run: Callable[[], None]) -> CapturedGraph:
        self.captured += 1
        return _CountedGraph(self.capture(run), self)


class _CountedGraph:
    def __init__(self, graph: CapturedGraph, factory: CountingGraphFactory) -> None:
        self.graph, self.factory = graph, factory

    def replay(self) -> None:
        self.factory.replays += 1
        self.graph.replay()

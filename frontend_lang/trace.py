"""``program.trace(**args)``: a program's graph, recorded without running a model.

The program runs on a tracing state: ``s += ...``, forks and joins are recorded as in a
compiled run (``frontend_lang/compiled.py``), and the first read of the state (``s["x"]``,
``s.text()``, ...) stops the trace, since what the program does next may depend on the value
it read: that point is a ``dynamic`` node. The graph's nodes are text, gen, select, fork,
join, role boundaries and that dynamic point; its edges are ``prefix`` (a node continues the
text of the one before it), ``fork`` (a branch starts from its fork) and ``join`` (a branch's
variables flow back to its parent).

``str(graph)`` lists it; ``graph.to_dot()`` is Graphviz source; ``graph.render(path)`` writes a
PNG where Graphviz's ``dot`` is installed, else the listing as text.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from frontend_lang.backends.base import Backend, ChoiceLogprobs, GenOutput, Prompt
from frontend_lang.chat import ChatTemplate
from frontend_lang.compiled import ForkRecord, Item, JoinRecord, TraceStop, _Shadow, lower
from frontend_lang.ir import Gen, Role, RoleBegin, RoleEnd, Select, Seq, Text

if TYPE_CHECKING:
    from frontend_lang.program import Function
    from frontend_lang.state import ProgramState

_SHAPES = {
    "text": "box",
    "gen": "ellipse",
    "select": "diamond",
    "fork": "trapezium",
    "join": "invtrapezium",
    "role": "plaintext",
    "dynamic": "octagon",
}


@dataclass(frozen=True)
class Node:
    id: int
    kind: str  # text, gen, select, fork, join, role, dynamic
    label: str
    branch: str  # "" for the program's own state, "/<fork>.<i>" for a branch
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProgramGraph:
    name: str
    nodes: list[Node]
    edges: list[tuple[int, int, str]]
    dynamic: str | None  # why the trace stopped (None: the whole program is static)
    root_items: list[Item]

    @property
    def is_static(self) -> bool:
        return self.dynamic is None

    def of_kind(self, kind: str) -> list[Node]:
        return [n for n in self.nodes if n.kind == kind]

    def static_prefix(self, template: ChatTemplate) -> str:
        """The text the program starts with before its first gen, select, fork or read."""
        ops: list[dict[str, Any]] = []
        shadow = _Shadow(False)
        text: list[str] = []
        for item in self.root_items:
            if isinstance(item, ForkRecord | JoinRecord):
                break
            ops.clear()
            lower(item, shadow, template, ops)
            for op in ops:
                if op["type"] != "text":
                    return "".join(text)
                text.append(op["text"])
        return "".join(text)

    def __str__(self) -> str:
        lines = [f"program {self.name}: {len(self.nodes)} nodes"]
        for node in self.nodes:
            depth = node.branch.count("/")
            where = f" [{node.branch}]" if node.branch else ""
            lines.append(f"{'  ' * (depth + 1)}{node.id}: {node.kind} {node.label}{where}")
        if self.dynamic is not None:
            lines.append(f"  (dynamic from here: the program {self.dynamic})")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz source of the graph."""
        out = [f"digraph {_quote(self.name)} {{", "  rankdir=TB;", '  node [fontname="mono"];']
        for node in self.nodes:
            label = f"{node.kind}\\n{_escape(node.label)}"
            out.append(f"  n{node.id} [label={_quote_raw(label)}, shape={_SHAPES[node.kind]}];")
        for src, dst, kind in self.edges:
            style = {"prefix": "solid", "fork": "bold", "join": "dashed"}[kind]
            out.append(f"  n{src} -> n{dst} [style={style}];")
        out.append("}")
        return "\n".join(out)

    def render(self, path: str | Path) -> Path:
        """Write the graph as a PNG at ``path`` with Graphviz's ``dot``; without Graphviz, its
        listing as text next to it (``path`` with a .txt suffix). Returns the file written."""
        target = Path(path)
        dot = shutil.which("dot")
        if dot is not None:
            subprocess.run(
                [dot, "-Tpng", "-o", str(target)],
                input=self.to_dot().encode(),
                check=True,
                timeout=60,
            )
            return target
        text_path = target.with_suffix(".txt")
        text_path.write_text(str(self) + "\n")
        return text_path


def trace_program(
    function: Function, args: tuple[Any, ...], kwargs: dict[str, Any], backend: Backend | None
) -> ProgramGraph:
    from frontend_lang.state import ProgramState, RunContext

    bound = function._bind(args, kwargs)
    run = RunContext(function.name, backend or _NoModel(), tracing=True)
    assert run.compiled is not None
    state = ProgramState(run)
    run.program_thread = threading.get_ident()
    stop: TraceStop | None = None
    try:
        function.func(state, *bound.args, **bound.kwargs)
    except TraceStop as exc:
        stop = exc
    finally:
        for branch in run.branches:
            branch._close_worker()
    return _Builder(run.compiled, function.name).build(state, stop)


class _Builder:
    def __init__(self, compiled: Any, name: str) -> None:
        self.compiled = compiled
        self.name = name
        self.nodes: list[Node] = []
        self.edges: list[tuple[int, int, str]] = []
        self.fork_ends: dict[int, list[int]] = {}
        self.last: dict[str, list[int]] = {}

    def build(self, root: ProgramState, stop: TraceStop | None) -> ProgramGraph:
        items = list(self.compiled.items(root))
        self._walk(items, [], "")
        if stop is not None:
            key = self.compiled.key(stop.state)
            self._add("dynamic", stop.reason, key, self.last.get(key, []), {"reason": stop.reason})
        return ProgramGraph(
            self.name, self.nodes, self.edges, None if stop is None else stop.reason, items
        )

    def _add(
        self, kind: str, label: str, branch: str, prev: list[int], detail: dict[str, Any],
        edge: str = "prefix",
    ) -> list[int]:  # fmt: skip
        node = Node(len(self.nodes), kind, label, branch, detail)
        self.nodes.append(node)
        self.edges.extend((p, node.id, edge) for p in prev)
        self.last[branch] = [node.id]
        return [node.id]

    def _walk(self, items: list[Any], prev: list[int], key: str, edge: str = "prefix") -> list[int]:
        for item in items:
            prev = self._item(item, prev, key, edge)
            edge = "prefix"
        self.last[key] = prev
        return prev

    def _item(self, item: Any, prev: list[int], key: str, edge: str) -> list[int]:
        if isinstance(item, Text):
            return self._add("text", _short(item.text), key, prev, {"text": item.text}, edge)
        if isinstance(item, Seq):
            return self._walk(list(item.parts), prev, key, edge)
        if isinstance(item, Gen):
            params = item.sampling_params()
            return self._add("gen", str(item.name), key, prev, {"sampling_params": params}, edge)
        if isinstance(item, Select):
            label = f"{item.name} {list(item.choices)}"
            return self._add("select", _short(label), key, prev, {"choices": item.choices}, edge)
        if isinstance(item, Role):
            prev = self._add("role", f"<{item.role}>", key, prev, {"role": item.role}, edge)
            if item.content is not None:
                prev = self._item(item.content, prev, key, "prefix")
            return self._add("role", f"</{item.role}>", key, prev, {"role": item.role})
        if isinstance(item, RoleBegin):
            return self._add("role", f"<{item.role}>", key, prev, {"role": item.role}, edge)
        if isinstance(item, RoleEnd):
            return self._add("role", f"</{item.role}>", key, prev, {"role": item.role}, edge)
        if isinstance(item, ForkRecord):
            width = len(item.branches)
            fork = self._add("fork", f"x{width}", key, prev, {"fork_id": item.fork_id}, edge)
            ends = []
            for branch in item.branches:
                branch_key = self.compiled.key(branch)
                self.last[branch_key] = fork
                ends.extend(self._walk(self.compiled.items(branch), fork, branch_key, "fork"))
            self.fork_ends[item.fork_id] = ends
            self.last[key] = fork
            return fork
        if isinstance(item, JoinRecord):
            fork_id = item.group.fork_id
            join = self._add("join", f"fork {fork_id}", key, prev, {"fork_id": fork_id}, edge)
            ends = self.fork_ends.get(fork_id, []) if fork_id is not None else []
            self.edges.extend((end, join[0], "join") for end in ends)
            return join
        raise TypeError(f"unknown expression {item!r}")


class _NoModel(Backend):
    """The backend of a trace with none given: programs are recorded, never run."""

    @property
    def chat_template(self) -> ChatTemplate:
        from frontend_lang.chat import CHATML

        return CHATML

    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], on_delta: Any = None
    ) -> GenOutput:
        raise RuntimeError("a traced program does not generate")

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> ChoiceLogprobs:
        raise RuntimeError("a traced program does not score")

    def unconditional_logprobs(self, choices: list[str]) -> list[list[float]]:
        raise RuntimeError("a traced program does not score")


def _short(text: str, width: int = 40) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 4] + "...'"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _quote(text: str) -> str:
    return '"' + _escape(text) + '"'


def _quote_raw(text: str) -> str:
    return '"' + text + '"'

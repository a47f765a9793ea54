"""Each part of a ``Req`` is written by one manager only: an assignment to a part's field (or
to the part itself) anywhere else in the product is a defect (the managers change their
parts through their own methods)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# part attribute on Req -> the one module that may assign its fields
OWNERS = {
    "kv": "runtime/scheduler/kv_manager.py",
    "constraint": "runtime/scheduler/grammar_manager.py",
    "out": "runtime/scheduler/output_processor.py",
    "penalties": "runtime/sampler.py",
    "draft": "runtime/speculative/drafts.py",
}
# where Req makes its parts
REQ_MODULE = "runtime/scheduler/req.py"


def _assigned_parts(tree: ast.AST) -> set[tuple[str, int]]:
    """(part, line) for each ``x.<part>.<field> = ...`` / ``x.<part>.<field> += ...`` and each
    ``x.<part> = ...`` where x is not ``self``."""
    found = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if not isinstance(leaf, ast.Attribute):
                    continue
                base = leaf.value
                if isinstance(base, ast.Attribute) and base.attr in OWNERS:
                    if not _is_self(base.value):  # the managers' own ``self.kv``, ``self.out``
                        found.add((base.attr, node.lineno))
                elif leaf.attr in OWNERS and not _is_self(base):
                    found.add((leaf.attr, node.lineno))
    return found


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def test_the_check_sees_writes_of_parts():
    code = "req.kv.row = 1\nr.draft.tokens += [1]\nreq.out = None\nself.kv.tree = None\n"
    assert _assigned_parts(ast.parse(code)) == {("kv", 1), ("draft", 2), ("out", 3)}


def test_each_part_of_a_request_is_written_by_its_manager_only():
    offences = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for part, line in _assigned_parts(ast.parse(path.read_text())):
            if name not in (OWNERS[part], REQ_MODULE):
                offences.append(f"{name}:{line} writes req.{part}")
    assert not offences, "\n".join(offences)

"""The one ``$ref`` resolver of every schema pass, and the document shape it hands them.

A ``$ref`` is a URI reference resolved against the document's base URI (the root's ``$id``,
``id`` in drafts 3-4); its fragment is a JSON pointer (RFC 6901: any depth, ``~0``/``~1``
escapes, percent-encoding). References into the same document are supported, however they are
spelled (``#/definitions/a``, ``s.json#/definitions/a`` under ``$id: https://x/s.json``);
anything else (another document, an anchor, a nested ``$id`` scope) is refused by name.

Passes must never see different targets, and a target must never escape them: xgrammar
resolves pointers itself but knows no escapes, and a target reached only through a pointer
(``#/definitions/root/full``) was never walked by the checks, so its ``allOf`` reached the
backend unmerged and the schema was enforced as any JSON. So ``hoist_refs`` rewrites the
document once, before anything else looks at it: every reachable target becomes an entry of
one root table (``$defs``; ``definitions`` in drafts up to 7, whose metaschema checks those),
named by its own JSON pointer in the schema as written, and every ``$ref`` becomes ``#`` or
``#/$defs/<that pointer, escaped>``. Recursion stays a reference, never an expansion. The
walkers (``schema_walk.iter_subschemas``) give each entry's subschemas the pointers of the
schema as written, so messages name what the user wrote; ``backend_refs`` renames the entries
to names xgrammar reads just before it gets the document.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from grammar.errors import GrammarError, UnsupportedSchemaFeature
from grammar.schema_rewrite import ANNOTATIONS, DEFS
from grammar.schema_walk import (
    LISTS,
    MAPS,
    SINGLE,
    escape_pointer,
    is_old_draft,
    iter_subschemas,
)

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
# Keywords whose subschemas apply to the value of the subschema holding them.
_IN_PLACE = frozenset(
    {"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies"}
)
_BAD_ESCAPE = re.compile(r"~(?![01])")
# The most references (counted with the nesting around them) a check of the schema's meaning
# follows before it calls the answer unknown: a cycle of references never ends.
MAX_REF_HOPS = 32


@dataclass(frozen=True)
class Target:
    """What a ``$ref`` points to: its JSON pointer ("" for the root) and the value there."""

    pointer: str
    schema: Any


def table_key(schema: dict[str, Any]) -> str:
    """The root keyword that holds (or will hold) the reference targets of a hoisted
    ``schema``: the one it has (hoisting leaves no other, and lowering may drop ``$schema``),
    else ``definitions`` in drafts up to 7 (whose metaschema checks those), else ``$defs``."""
    for key in DEFS:
        if isinstance(schema.get(key), dict):
            return key
    return "definitions" if is_old_draft(schema) else "$defs"


def resolve_ref(root: dict[str, Any], ref: str, pointer: str = "") -> Target:
    """The target of the ``$ref`` value ``ref`` found in the subschema at ``pointer`` of the
    document ``root``: one hop, not followed further.

    Raises UnsupportedSchemaFeature for a reference this resolver does not follow (another
    document, an anchor) and GrammarError for one that points nowhere or not at a schema."""
    where = f"{pointer}/$ref"
    base = base_uri(root)
    if ref.startswith("#"):
        document, fragment = base, ref[1:]
    else:
        document, fragment = urldefrag(urljoin(base, ref))
    if document != base:
        raise UnsupportedSchemaFeature(
            "$ref",
            pointer,
            f"{ref!r} points outside this document (its base URI is {base or 'unset'}); only "
            "references into the schema itself are resolved",
        )
    fragment = unquote(fragment)
    if fragment and not fragment.startswith("/"):
        raise UnsupportedSchemaFeature(
            "$ref", pointer, f"{ref!r} names an anchor; use a JSON pointer such as '#/$defs/...'"
        )
    node: Any = root
    path: list[str] = []
    for token in fragment.split("/")[1:]:
        if _BAD_ESCAPE.search(token):
            raise GrammarError(f"invalid JSON schema at {where}: {ref!r} has a bad '~' escape")
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and _ARRAY_INDEX.fullmatch(key) and int(key) < len(node):
            node = node[int(key)]
        else:
            raise GrammarError(f"invalid JSON schema at {where}: {ref!r} points nowhere")
        path.append(key)
    if not isinstance(node, dict | bool):
        kind = type(node).__name__
        raise GrammarError(f"invalid JSON schema at {where}: {ref!r} points at a {kind}")
    return Target("".join(f"/{escape_pointer(key)}" for key in path), node)


def follow_refs(root: dict[str, Any], schema: Any, hops: int) -> tuple[Any, int]:
    """``schema``, or where its chain of ``$ref``s ends (the first target that is no reference),
    and ``hops`` plus the references followed; None for the schema once ``hops`` would pass
    MAX_REF_HOPS (e.g. a cycle), which a check reads as unknown."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        if hops >= MAX_REF_HOPS:
            return None, hops
        schema, hops = resolve_ref(root, schema["$ref"]).schema, hops + 1
    return schema, hops


def base_uri(root: dict[str, Any]) -> str:
    """The URI references in ``root`` resolve against ("" when it declares none). As the
    ``jsonschema`` validators read it: drafts up to 7 ignore an ``$id`` beside ``$ref`` and
    one that is only a fragment (a location-independent name there)."""
    value = root.get(_id_keyword(root))
    old = is_old_draft(root)
    if not isinstance(value, str) or (old and ("$ref" in root or value.startswith("#"))):
        return ""
    return urldefrag(value)[0]


def hoist_refs(schema: dict[str, Any], best_effort: bool) -> dict[str, Any]:
    """``schema`` with every reachable ``$ref`` target moved into the root table (see the
    module's docstring); unreachable definitions, ``$id``s and the siblings that drafts up to
    7 ignore beside a ``$ref`` are left out. A reference this resolver does not follow and a
    nested ``$id`` that moves the base URI are refused (by name), except under
    ``best_effort``, where the reference admits anything and references under the ``$id``
    resolve against the root's base (the validator of ``strict_mode: "validate"`` decides)."""
    return _Hoister(schema, best_effort).run()


def backend_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A hoisted ``schema`` (lowered) with its table entries renamed ``ref0``, ``ref1``...:
    xgrammar resolves plain pointers itself and reads no ``~`` escapes. Modified in place."""
    key = table_key(schema)
    table = schema.get(key)
    if not isinstance(table, dict) or not table:
        return schema
    names = {f"#/{key}/{escape_pointer(name)}": f"ref{i}" for i, name in enumerate(table)}
    schema[key] = {names[f"#/{key}/{escape_pointer(n)}"]: entry for n, entry in table.items()}
    for _, sub in iter_subschemas(schema):
        ref = sub.get("$ref")
        if isinstance(ref, str) and ref in names:
            sub["$ref"] = f"#/{key}/{names[ref]}"
    return schema


def _id_keyword(schema: dict[str, Any]) -> str:
    declared = str(schema.get("$schema", ""))
    return "id" if "draft-03" in declared or "draft-04" in declared else "$id"


class _Hoister:
    def __init__(self, schema: dict[str, Any], best_effort: bool) -> None:
        self.root = schema
        self.best_effort = best_effort
        self.old = is_old_draft(schema)
        self.id_keyword = _id_keyword(schema)
        self.base = base_uri(schema)
        self.key = "definitions" if self.old else "$defs"
        self.targets: dict[str, Any] = {}  # pointer -> the value there, in discovery order
        # (tree, target, where): the tree at pointer ``tree`` applies ``target`` to its own
        # value (through in-place keywords only), by the reference or cut at ``where``.
        self.in_place: list[tuple[str, str, str]] = []
        self.tree = ""

    def run(self) -> dict[str, Any]:
        # The first pass finds every target (a tree is built for each as it is found); the
        # second builds the trees again, now cutting every target out of the tree around it.
        for _ in range(2):
            self.in_place.clear()
            trees: dict[str, Any] = {"": self._build(self.root, "", top=True)}
            while len(trees) <= len(self.targets):
                for pointer in list(self.targets)[len(trees) - 1 :]:
                    self.tree = pointer
                    trees[pointer] = self._build(self.targets[pointer], pointer, top=True)
            self.tree = ""
        self._check_loops()
        root = trees.pop("")
        if root is False:
            raise GrammarError("the JSON schema admits no value: its $ref points at false")
        document: dict[str, Any] = {} if root is True else root
        if "$schema" in self.root:  # the draft decides how later passes read the keywords
            document["$schema"] = self.root["$schema"]
        if trees:
            document[self.key] = trees
        return document

    def _build(self, node: Any, pointer: str, top: bool = False, in_place: bool = True) -> Any:
        """The hoisted copy of the subschema ``node`` found at ``pointer``; ``in_place``: it
        applies to the value its tree applies to (reached through in-place keywords only)."""
        if not isinstance(node, dict):
            return copy.deepcopy(node)
        if not top and pointer in self.targets:
            if in_place:
                self.in_place.append((self.tree, pointer, pointer))
            return {"$ref": self._ref_to(pointer)}
        ref = node.get("$ref")
        if isinstance(ref, str):
            try:
                target = self._follow(ref, pointer)
            except UnsupportedSchemaFeature:
                if not self.best_effort:
                    raise
                target = Target("", True)  # unenforced: anything (the caller opted in)
            if in_place and not isinstance(target.schema, bool):
                self.in_place.append((self.tree, target.pointer, f"{pointer}/$ref"))
            if target.schema is False:
                return False
            if target.schema is True:  # as {}: drafts 3-4 have no boolean schemas
                node = {} if self.old else {k: v for k, v in node.items() if k != "$ref"}
            elif self.old:
                return {"$ref": self._ref_to(target.pointer)}
            else:
                node = {**node, "$ref": self._ref_to(target.pointer)}
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in DEFS:
                continue  # reached only through references, which now point into the table
            if key == self.id_keyword:
                self._check_id(value, pointer)
                continue
            out[key] = self._build_keyword(key, value, pointer, in_place and key in _IN_PLACE)
        return out

    def _build_keyword(self, key: str, value: Any, pointer: str, in_place: bool) -> Any:
        where = f"{pointer}/{key}"
        if key in SINGLE or (key == "items" and not isinstance(value, list)):
            return self._build(value, where, in_place=in_place)
        if (key in LISTS or key == "items") and isinstance(value, list):
            return [
                self._build(sub, f"{where}/{i}", in_place=in_place) for i, sub in enumerate(value)
            ]
        if (key in MAPS or key == "dependencies") and isinstance(value, dict):
            return {
                name: self._build(sub, f"{where}/{escape_pointer(name)}", in_place=in_place)
                for name, sub in value.items()
            }
        return copy.deepcopy(value)

    def _check_loops(self) -> None:
        """Refuse a reference that leads back to a subschema applying it to the same value:
        a validator evaluating it never finishes (``{"anyOf": [{"$ref": "#"}, ...]}``)."""
        edges: dict[str, list[tuple[str, str]]] = {}
        for tree, target, where in self.in_place:
            edges.setdefault(tree, []).append((target, where))
        state: dict[str, str] = {}
        for start in edges:
            if start in state:
                continue
            state[start] = "open"
            stack = [(start, iter(edges[start]))]
            while stack:
                node, pending = stack[-1]
                step = next(pending, None)
                if step is None:
                    state[node] = "done"
                    stack.pop()
                elif state.get(step[0]) == "open":
                    raise GrammarError(
                        f"invalid JSON schema at {step[1]}: it leads back to the subschema at "
                        f"{step[0] or '/'} without entering a property or an item, a loop no "
                        "validator finishes"
                    )
                elif step[0] not in state:
                    state[step[0]] = "open"
                    stack.append((step[0], iter(edges.get(step[0], []))))

    def _follow(self, ref: str, pointer: str) -> Target:
        """The target of ``ref`` past any chain of references that only refer on."""
        target = resolve_ref(self.root, ref, pointer)
        seen = {target.pointer}
        while self._only_refers(target.schema):
            target = resolve_ref(self.root, target.schema["$ref"], target.pointer)
            if target.pointer in seen:
                raise GrammarError(
                    f"invalid JSON schema at {pointer}/$ref: {ref!r} leads to a cycle of "
                    "references that only refer to each other, which admits no value"
                )
            seen.add(target.pointer)
        if target.pointer and not isinstance(target.schema, bool):
            self.targets.setdefault(target.pointer, target.schema)
        return target

    def _only_refers(self, node: Any) -> bool:
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
            return False
        if self.old:
            return True  # drafts up to 7 ignore a reference's siblings
        return all(k == "$ref" or k in ANNOTATIONS or k in DEFS for k in node)

    def _check_id(self, value: Any, pointer: str) -> None:
        """A nested ``$id`` (``id`` in drafts 3-4) that moves the base URI is refused: the
        references under it would resolve elsewhere. A fragment-only one (a name in drafts
        up to 7) or one naming the document itself changes nothing."""
        if not pointer or self.best_effort or not isinstance(value, str):
            return
        if self.old and value.startswith("#"):
            return
        if urldefrag(urljoin(self.base, value))[0] == self.base and self.base:
            return
        raise UnsupportedSchemaFeature(
            self.id_keyword,
            pointer,
            "a nested base URI changes where references resolve, which is not supported",
        )

    def _ref_to(self, pointer: str) -> str:
        return f"#/{self.key}/{escape_pointer(pointer)}" if pointer else "#"

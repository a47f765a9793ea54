"""Combine a schema's own keywords with its ``allOf`` / ``anyOf`` / ``oneOf`` subschemas.

xgrammar 0.2.8 builds a combinator's grammar from its subschemas alone: the keywords beside
it are dropped (``{"type": "integer", "anyOf": [{"minimum": 0}, ...]}`` emitted strings). So
before checking and lowering, every subschema holding a combinator is rewritten into one the
backend enforces exactly:

- ``allOf``: its subschemas are merged into the schema (their conjunction, keyword by keyword);
- ``anyOf`` / ``oneOf`` beside other keywords: those keywords are merged into each branch
  (``S and anyOf(B1..Bn)`` is ``anyOf(S and B1, .., S and Bn)``; the same holds for oneOf,
  since every branch gets the same conjunct); branches that admit nothing are dropped;
- ``$ref`` beside other keywords: in drafts 2019-09 and 2020-12 the referenced schema is merged
  with them (drafts 4 to 7 ignore a reference's siblings: ``schema_refs`` dropped them).

``merge`` is exact for the keywords it knows: types intersect (integer within number),
enum/const values intersect, bounds tighten, ``required`` unites, ``properties`` merge by name
(a name one side lacks meets the other side's ``additionalProperties``), ``items`` merge. Two
different values of a keyword it cannot intersect (two patterns, two formats,
``patternProperties`` on both sides...) raise UnsupportedSchemaFeature naming the keyword and
the subschema: a schema is never weakened in silence.

The same pass applies the single-subschema rewrites of ``schema_rewrite`` (typeless keywords,
property dependencies), conditionals on one enum property (``_expand_conditional``),
``schema_lengths`` (lengths beside a pattern), and merges a declared property with the
``patternProperties`` schemas whose patterns match its name.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from grammar.errors import GrammarError, UnsupportedSchemaFeature
from grammar.schema_lengths import fold_format_into_pattern, fold_lengths_into_pattern
from grammar.schema_refs import resolve_ref, table_key
from grammar.schema_rewrite import (
    ANNOTATIONS,
    COMBINATORS,
    DEFS,
    MAX_BRANCHES,
    Schema,
    canonical,
    expand_dependencies,
    finite_values,
    property_test,
    split_by_type,
)
from grammar.schema_walk import LISTS, MAPS, SINGLE, entry_pointer, escape_pointer, iter_subschemas

_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT = ("properties", "patternProperties", "additionalProperties")
_MAX_INLINED_REFS = 16
# Subschemas whose merges may inline references, rewritten one inside another.
_MAX_NESTED_MERGES = 64


def distribute_combinators(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a hoisted ``schema`` (``schema_refs.hoist_refs``) in which no combinator or
    ``$ref`` has constraining siblings; its table entries are rewritten too, and hold
    whatever a recursion needed (below)."""
    key = table_key(schema)
    empty: set[str] = set()
    while True:  # again while entries turn out to admit nothing (rarely more than once)
        rewriter = _Rewriter(schema, empty)
        root = rewriter.rewrite(copy.deepcopy(rewriter.target("#", "")), "")
        table = {
            name: rewriter.rewrite(copy.deepcopy(entry), name)
            for name, entry in (schema.get(key) or {}).items()
        }
        found = {name for name, entry in table.items() if entry is False}
        if found <= empty:
            break
        empty |= found
    if root is False:
        raise GrammarError("the JSON schema admits no value: its combined keywords conflict")
    if root is True:
        root = {}
    table = _reachable(root, key, {**table, **rewriter.added})
    if table:
        root[key] = table
    return root


def _reachable(root: dict[str, Any], key: str, table: dict[str, Schema]) -> dict[str, Schema]:
    """The entries of ``table`` that references from ``root`` lead to (merging may have
    inlined the only reference to one). GrammarError if one admits no value: only a
    reference to an entry made for a recursion can still point at ``False``."""
    names = {_ref_to(key, name): name for name in table}
    kept: dict[str, Schema] = {}
    pending: list[Schema] = [root]
    while pending:
        for _, sub in iter_subschemas(pending.pop()):
            name = names.get(sub.get("$ref", ""))
            if name is not None and name not in kept:
                if table[name] is False:
                    raise GrammarError(f"the JSON schema at {name} admits no value")
                kept[name] = table[name]
                pending.append(table[name])
    return {name: entry for name, entry in table.items() if name in kept}


class _Rewriter:
    """Rewrites subschemas of the hoisted document ``source``, which it never modifies:
    merging a reference inlines a copy of its target as written.

    Inlining can recur without end: a target holding the reference with the same siblings
    (``{"$ref": "#", "required": ["a"]}`` inside the root) yields, once merged, a subschema
    holding it again. A subschema met again while it is being rewritten therefore becomes a
    reference to a new table entry that holds its rewritten form: recursion stays recursion.
    """

    def __init__(self, source: dict[str, Any], empty: set[str]) -> None:
        self.source = source
        self.key = table_key(source)
        self.added: dict[str, Schema] = {}  # entries made for recursions, by name
        self._named: dict[str, str] = {}  # canonical text of a subschema -> its entry's name
        self._active: dict[str, list[Any]] = {}  # canonical text -> [pointer, name or None]
        # References to the table entries known to admit nothing.
        self._empty = {_ref_to(self.key, name) for name in empty}

    def target(self, ref: str, pointer: str) -> Schema:
        """The value ``ref`` (a reference of the hoisted document) points to, as written; the
        root without its table."""
        if ref == "#":
            return {k: v for k, v in self.source.items() if k != self.key}
        for name, entry in self.added.items():
            if ref == _ref_to(self.key, name):
                return entry
        return resolve_ref(self.source, ref, pointer).schema  # type: ignore[no-any-return]

    def rewrite(self, sub: Any, pointer: str) -> Schema:
        """``sub`` with its own combinators resolved, then its subschemas rewritten."""
        if not isinstance(sub, dict):
            return sub  # type: ignore[no-any-return]
        if sub.get("$ref") in self._empty and not _constraining(sub, exclude=("$ref",)):
            # False here, where the parent knows what that means (an optional property never
            # written, a branch dropped); the backend refuses a reference to false.
            return False
        if not _resolves_here(sub):
            return self._rewrite(sub, pointer)
        key = canonical(sub)
        if key in self._named:
            return {"$ref": _ref_to(self.key, self._named[key])}
        if key in self._active:  # met again inside its own rewrite: refer to it
            frame = self._active[key]
            if frame[1] is None:
                frame[1] = self._entry_name(frame[0])
            return {"$ref": _ref_to(self.key, frame[1])}
        if len(self._active) >= _MAX_NESTED_MERGES:
            raise UnsupportedSchemaFeature(
                "$ref", pointer, "references combined with other keywords nest too deeply"
            )
        self._active[key] = [pointer, None]
        try:
            rewritten = self._rewrite(sub, pointer)
        finally:
            name = self._active.pop(key)[1]
        if name is None:
            return rewritten
        self.added[name] = rewritten
        self._named[key] = name
        return {"$ref": _ref_to(self.key, name)}

    def _entry_name(self, pointer: str) -> str:
        """A table name for the subschema at ``pointer``: its pointer (as messages show it)
        plus ``/$ref``, which no target's pointer ends with (a ``$ref`` holds a string)."""
        taken = (
            set(self.added)
            | set(self.source.get(self.key) or ())
            | {frame[1] for frame in self._active.values()}
        )
        name, n = f"{pointer}/$ref", 1
        while name in taken:
            n += 1
            name = f"{pointer}/$ref~{n}"  # '~' then a digit: never an escaped pointer either
        return name

    def _rewrite(self, sub: Any, pointer: str) -> Schema:
        sub = self._expand_conditional(self._resolve_here(sub, pointer), pointer)
        sub = expand_dependencies(split_by_type(sub), pointer)
        if isinstance(sub, bool):
            return sub
        fold_format_into_pattern(sub)
        fold_lengths_into_pattern(sub)
        self._merge_matching_patterns(sub, pointer)
        for key in SINGLE + ("items",):
            if isinstance(sub.get(key), dict):
                sub[key] = self.rewrite(sub[key], f"{pointer}/{key}")
        if isinstance(sub.get("items"), list):
            sub["items"] = [
                self.rewrite(s, f"{pointer}/items/{i}") for i, s in enumerate(sub["items"])
            ]
        for key in MAPS:
            if isinstance(sub.get(key), dict):
                sub[key] = {
                    name: self.rewrite(s, entry_pointer(pointer, key, name))
                    for name, s in sub[key].items()
                }
        for key in LISTS:
            if isinstance(sub.get(key), list):
                branches = [self.rewrite(s, f"{pointer}/{key}/{i}") for i, s in enumerate(sub[key])]
                if key in ("anyOf", "oneOf"):  # a branch admitting nothing adds nothing
                    branches = [b for b in branches if b is not False]
                    if not branches:
                        return False
                sub[key] = branches
        return sub

    def _merge_matching_patterns(self, sub: dict[str, Any], pointer: str) -> None:
        """A declared property whose name a ``patternProperties`` pattern matches must satisfy
        both schemas; the backend applies the declared one only (measured: ``{"xa":false}``
        for ``xa: boolean`` beside ``^x: integer``). So they are merged."""
        properties, patterns = sub.get("properties"), sub.get("patternProperties")
        if not isinstance(properties, dict) or not isinstance(patterns, dict):
            return
        for name in properties:
            for pattern, schema in patterns.items():
                if schema is True or schema == {}:
                    continue
                try:
                    matched = re.search(pattern, name) is not None
                except re.error:
                    continue  # the checker refuses the pattern
                if matched:
                    where = f"{pointer}/properties/{escape_pointer(name)}"
                    properties[name] = self.merge(properties[name], schema, where)

    def _resolve_here(self, sub: dict[str, Any], pointer: str) -> Schema:
        """Fold ``allOf`` into ``sub``, merge a ``$ref`` with its siblings, and distribute the
        siblings of ``anyOf``/``oneOf`` into the branches."""
        if isinstance(sub.get("$ref"), str) and _constraining(sub, exclude=("$ref",)):
            # Drafts up to 7 ignore these siblings: hoisting dropped them there.
            ref = sub.pop("$ref")
            sub = {"allOf": [{"$ref": ref}, *sub.pop("allOf", [])], **sub}
        all_of = sub.get("allOf")
        if isinstance(all_of, list):
            rest: Schema = {k: v for k, v in sub.items() if k != "allOf"}
            for i, branch in enumerate(all_of):
                rest = self.merge(rest, branch, f"{pointer}/allOf/{i}")
            # A merge with nothing to merge returns its other side as it is, which may hold a
            # combinator or a reference beside other keywords ({"allOf": [{"type": "object",
            # "anyOf": [{"const": null}]}]} wrote null).
            return self._resolve_here(rest, pointer) if isinstance(rest, dict) else rest
        has = [key for key in ("anyOf", "oneOf") if isinstance(sub.get(key), list)]
        if not has or (len(has) == 1 and not _constraining(sub, exclude=("anyOf", "oneOf"))):
            return sub
        return self._merge_combined(sub, {}, pointer, 0)

    def _expand_conditional(self, sub: Schema, pointer: str) -> Schema:
        """``if``/``then``/``else`` whose ``if`` tests one property against const/enum values,
        as an exact ``anyOf``: (if and then) or (not if and else). "Not if" is the property
        holding one of the other values its schema allows (an enum, a const or a boolean), or,
        when the ``if`` requires it, the property absent (objects holding only their declared
        properties). Any other ``if`` stays, and the checker refuses it."""
        if not isinstance(sub, dict) or "if" not in sub:
            return sub
        test = property_test(sub["if"])
        rest = {k: v for k, v in sub.items() if k not in ("if", "then", "else")}
        declared = rest.get("properties")
        if test is None or not isinstance(declared, dict) or test[0] not in declared:
            return sub
        name, tested, required = test
        domain = finite_values(declared[name])
        strict = rest.get("additionalProperties", False) is False
        if domain is None or not strict or "patternProperties" in rest:
            return sub
        others = [v for v in domain if canonical(v) not in {canonical(t) for t in tested}]
        where = f"{pointer}/if"
        branches = [
            self.merge(self.merge(rest, sub["if"], where), sub.get("then", True), where),
        ]
        otherwise: list[Schema] = []
        if others:
            other_values = {"properties": {name: {"enum": others}}, "required": [name]}
            otherwise.append(self.merge(rest, other_values, where))
        if required and name not in (rest.get("required") or ()):
            without = {k: v for k, v in declared.items() if k != name}
            otherwise.append({**rest, "properties": without})
        for negation in otherwise:
            branches.append(self.merge(negation, sub.get("else", True), where))
        kept = [b for b in branches if b is not False]
        if not kept:
            return False
        return kept[0] if len(kept) == 1 else {"anyOf": kept}

    # ---- the conjunction of two schemas ---------------------------------------------------

    def merge(self, a: Schema, b: Schema, pointer: str, refs: int = 0) -> Schema:
        """A schema admitting exactly the values both ``a`` and ``b`` admit (False: none).
        refs: references inlined on the way here (a recursive one would never end)."""
        if a is False or b is False:
            return False
        if a is True or a == {}:
            return copy.deepcopy(b)
        if b is True or b == {}:
            return copy.deepcopy(a)
        assert isinstance(a, dict) and isinstance(b, dict)
        for side, other in ((a, b), (b, a)):
            if isinstance(side.get("$ref"), str):
                if refs >= _MAX_INLINED_REFS:
                    raise UnsupportedSchemaFeature(
                        "$ref", pointer, "a recursive reference cannot be combined with other "
                        "keywords",
                    )  # fmt: skip
                return self.merge(self._inline_ref(side, pointer), other, pointer, refs + 1)
        for side, other in ((a, b), (b, a)):
            if any(isinstance(side.get(k), list) for k in COMBINATORS):
                return self._merge_combined(side, other, pointer, refs)
        return self._merge_plain(a, b, pointer, refs)

    def _inline_ref(self, sub: dict[str, Any], pointer: str) -> Schema:
        ref = sub.get("$ref")
        if not isinstance(ref, str):
            return sub
        target = copy.deepcopy(self.target(ref, pointer))
        rest = {k: v for k, v in sub.items() if k != "$ref"}
        if isinstance(target, bool):
            return target if not rest else self.merge(target, rest, pointer)
        if not rest:
            return target  # type: ignore[no-any-return]
        return {"allOf": [target, rest]}

    def _merge_combined(
        self, side: dict[str, Any], other: dict[str, Any], pointer: str, refs: int
    ) -> Schema:
        """Merge where ``side`` holds allOf, anyOf or oneOf: fold allOf, distribute the rest."""
        rest = {k: v for k, v in side.items() if k not in COMBINATORS}
        if isinstance(side.get("allOf"), list):
            merged: Schema = {**rest, **{k: side[k] for k in ("anyOf", "oneOf") if k in side}}
            for i, branch in enumerate(side["allOf"]):
                merged = self.merge(merged, branch, f"{pointer}/allOf/{i}", refs)
            return self.merge(merged, other, pointer, refs)
        if isinstance(side.get("anyOf"), list) and isinstance(side.get("oneOf"), list):
            # Both hold: distribute one, then the other over its branches.
            first = self.merge({**rest, "anyOf": side["anyOf"]}, other, pointer, refs)
            return self.merge(first, {"oneOf": side["oneOf"]}, pointer, refs)
        key = "anyOf" if isinstance(side.get("anyOf"), list) else "oneOf"
        base = self.merge(rest, other, pointer, refs)
        branches: list[Schema] = []
        for i, branch in enumerate(side[key]):
            merged = self.merge(base, branch, f"{pointer}/{key}/{i}", refs)
            if merged is not False:
                branches.extend(_flatten(merged, key))
        if len(branches) > MAX_BRANCHES:
            raise UnsupportedSchemaFeature(
                key, pointer, f"combining it with its siblings makes over {MAX_BRANCHES} branches"
            )
        if not branches:
            return False
        return branches[0] if len(branches) == 1 else {key: branches}

    def _merge_plain(self, a: dict[str, Any], b: dict[str, Any], pointer: str, refs: int) -> Schema:
        out: dict[str, Any] = {}
        for key in a.keys() | b.keys():
            if key in _OBJECT:
                continue
            if key not in a or key not in b:
                out[key] = copy.deepcopy(a[key] if key in a else b[key])
                continue
            value = self._merge_keyword(key, a[key], b[key], pointer, refs)
            if value is _EMPTY:
                return False
            out[key] = value
        objects = self._merge_objects(a, b, pointer, refs)
        if objects is None:
            return False
        out.update(objects)
        return _normalised(out)

    def _merge_keyword(self, key: str, x: Any, y: Any, pointer: str, refs: int) -> Any:
        """Both sides' values of one keyword, combined (``_EMPTY``: nothing satisfies both)."""
        if key in ANNOTATIONS or _same(x, y):
            return copy.deepcopy(x)
        if key in DEFS and isinstance(x, dict) and isinstance(y, dict):
            return {**copy.deepcopy(y), **copy.deepcopy(x)}
        if key == "type":
            tx, ty = _types(x), _types(y)
            types = tx & ty
            if ("number" in tx and "integer" in ty) or ("integer" in tx and "number" in ty):
                types.add("integer")
            if not types:
                return _EMPTY
            return types.pop() if len(types) == 1 else sorted(types)
        if key == "const":
            return copy.deepcopy(x) if canonical(x) == canonical(y) else _EMPTY
        if key == "enum" and isinstance(x, list) and isinstance(y, list):
            wanted = {canonical(v) for v in y}
            common = [copy.deepcopy(v) for v in x if canonical(v) in wanted]
            return common if common else _EMPTY
        if key in _LOWER + _UPPER and _is_number(x) and _is_number(y):
            return max(x, y) if key in _LOWER else min(x, y)
        if key == "required" and isinstance(x, list) and isinstance(y, list):
            return list(dict.fromkeys([*x, *y]))
        if key == "multipleOf" and _is_int(x) and _is_int(y):
            return x * y // math.gcd(x, y)
        if key == "uniqueItems" and isinstance(x, bool) and isinstance(y, bool):
            return x or y
        if key in ("items", "propertyNames") and isinstance(x, dict | bool):
            if isinstance(y, dict | bool):
                merged = self.merge(x, y, f"{pointer}/{key}", refs)
                return merged
        raise UnsupportedSchemaFeature(
            key, pointer, "two different values of it cannot be combined exactly"
        )

    def _merge_objects(
        self, a: dict[str, Any], b: dict[str, Any], pointer: str, refs: int
    ) -> dict[str, Any] | None:
        """properties / patternProperties / additionalProperties of ``a`` and ``b`` together;
        None when a required property can have no value. Patterns merge exactly when neither
        side restricts additional keys (a key one side's patterns match would otherwise meet
        the other side's additionalProperties, which one schema cannot say)."""
        if not any(k in a for k in _OBJECT) or not any(k in b for k in _OBJECT):
            return {k: copy.deepcopy(s[k]) for s in (a, b) for k in _OBJECT if k in s}
        patterns_a = a.get("patternProperties") or {}
        patterns_b = b.get("patternProperties") or {}
        extra_a: Schema = a.get("additionalProperties", True)
        extra_b: Schema = b.get("additionalProperties", True)
        if (patterns_a or patterns_b) and not (_free(extra_a) and _free(extra_b)):
            raise UnsupportedSchemaFeature(
                "patternProperties",
                pointer,
                "it cannot be combined with an object schema that restricts additional keys",
            )
        props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
        properties: dict[str, Any] = {}
        for name in dict.fromkeys([*props_a, *props_b]):
            where = f"{pointer}/properties/{escape_pointer(name)}"
            mine = _value_schema(name, props_a, patterns_a, extra_a, where)
            theirs = _value_schema(name, props_b, patterns_b, extra_b, where)
            properties[name] = self.merge(mine, theirs, where, refs)
        required = set(a.get("required") or ()) | set(b.get("required") or ())
        if any(properties.get(name) is False for name in required):
            return None
        out: dict[str, Any] = {"properties": properties} if properties else {}
        patterns = copy.deepcopy(patterns_a)
        for pattern, schema in patterns_b.items():
            where = f"{pointer}/patternProperties/{escape_pointer(pattern)}"
            patterns[pattern] = (
                self.merge(patterns[pattern], schema, where, refs)
                if pattern in patterns
                else copy.deepcopy(schema)
            )  # a key both match must satisfy both: patternProperties already say so
        if patterns:
            out["patternProperties"] = patterns
        extra = self.merge(extra_a, extra_b, f"{pointer}/additionalProperties", refs)
        if extra is not True:
            out["additionalProperties"] = extra
        return out


def _resolves_here(sub: dict[str, Any]) -> bool:
    """Whether ``_Rewriter._resolve_here`` or ``_expand_conditional`` merge anything in
    ``sub`` (and so may inline references)."""
    if "if" in sub or isinstance(sub.get("allOf"), list):
        return True
    if isinstance(sub.get("$ref"), str) and _constraining(sub, exclude=("$ref",)):
        return True
    has = [key for key in ("anyOf", "oneOf") if isinstance(sub.get(key), list)]
    return len(has) > 1 or (len(has) == 1 and _constraining(sub, exclude=("anyOf", "oneOf")))


def _ref_to(key: str, name: str) -> str:
    return f"#/{key}/{escape_pointer(name)}"


def _free(extra: Schema) -> bool:
    return extra is True or extra == {}


def _value_schema(
    name: str, declared: dict[str, Any], patterns: dict[str, Any], extra: Schema, pointer: str
) -> Any:
    """What one object schema asks of the value of ``name``: its declared schema, else all the
    patterns that match the name, else its additionalProperties."""
    if name in declared:
        return declared[name]
    matching = []
    for pattern, schema in patterns.items():
        try:
            if re.search(pattern, name):
                matching.append(schema)
        except re.error:
            raise UnsupportedSchemaFeature(
                "patternProperties", pointer, f"pattern {pattern!r} is not a valid regex"
            ) from None
    if not matching:
        return extra
    return matching[0] if len(matching) == 1 else {"allOf": matching}


class _Empty:
    """A keyword whose combined value admits nothing."""


_EMPTY = _Empty()


def _constraining(sub: dict[str, Any], exclude: tuple[str, ...]) -> bool:
    return any(k not in ANNOTATIONS and k not in DEFS and k not in exclude for k in sub)


def _flatten(schema: Schema, key: str) -> list[Schema]:
    """A merged branch that is itself only a ``key`` list contributes its branches."""
    if isinstance(schema, dict) and set(schema) == {key}:
        return list(schema[key])
    return [schema]


def _types(value: Any) -> set[str]:
    return {value} if isinstance(value, str) else set(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _same(x: Any, y: Any) -> bool:
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def _normalised(out: dict[str, Any]) -> Schema:
    """Finish a merged schema: const and enum become one enum of their common values; False
    when none of them has one of its types (then an ``anyOf`` branch can be dropped)."""
    if "const" in out and "enum" in out:
        wanted = canonical(out.pop("const"))
        out["enum"] = [v for v in out["enum"] if canonical(v) == wanted]
        if not out["enum"]:
            return False
    values = [out["const"]] if "const" in out else out.get("enum")
    if isinstance(values, list) and "type" in out:
        types = _types(out["type"])
        if not any(_json_types(v) & types for v in values):
            return False
    return out


def _json_types(value: Any) -> set[str]:
    """The ``type`` names a JSON value satisfies."""
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return {names.get(type(value), "null")}

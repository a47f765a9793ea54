"""Rewrites of single subschemas into equivalent forms the backend enforces exactly.

Used by ``schema_merge`` before checking and lowering: typeless type-specific keywords split
into a per-type ``anyOf``; ``dependentRequired`` (and list-valued draft 4-7 ``dependencies``)
expanded into an exact ``anyOf`` on objects holding only their declared properties; and the
helpers that recognise a conditional's one-property const/enum test.
"""

from __future__ import annotations

import json
from typing import Any

from grammar.errors import UnsupportedSchemaFeature

COMBINATORS = ("allOf", "anyOf", "oneOf")
# Keywords that only annotate: a merge keeps the first side's value.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly", "$schema", "$id"}
)  # fmt: skip
DEFS = ("$defs", "definitions")
# Branches a rewrite may grow a schema to before it is refused.
MAX_BRANCHES = 64

Schema = dict[str, Any] | bool


# Keywords that constrain one JSON type only (other types satisfy them vacuously).
BY_TYPE = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "additionalItems", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames", "dependentRequired",
               "dependentSchemas", "dependencies", "unevaluatedProperties"),
}  # fmt: skip
_ALL_TYPES = ("null", "boolean", "number", "string", "array", "object")


def split_by_type(sub: Schema) -> Schema:
    """A schema with no ``type`` whose number, string or array keywords would be dropped by
    the backend (measured: ``{"minimum": 0}`` emitted any JSON value, negative numbers too),
    as the equivalent ``anyOf`` of one branch per type it constrains plus one for the types it
    leaves free. Object keywords alone stay: the backend then emits only objects, which is
    narrower but never invalid."""
    if not isinstance(sub, dict) or "type" in sub or "enum" in sub or "const" in sub:
        return sub
    if "$ref" in sub or any(k in sub for k in COMBINATORS):
        return sub
    present = [t for t, keys in BY_TYPE.items() if any(k in sub for k in keys)]
    if not set(present) & {"number", "string", "array"}:
        return sub
    typed = {k for keys in BY_TYPE.values() for k in keys}
    out = {k: v for k, v in sub.items() if k not in typed}
    branches: list[Schema] = [
        {"type": t, **{k: sub[k] for k in BY_TYPE[t] if k in sub}} for t in present
    ]
    free = [t for t in _ALL_TYPES if t not in present]
    if free:
        branches.append({"type": free})
    out["anyOf"] = branches
    return out


def property_test(schema: Any) -> tuple[str, list[Any], bool] | None:
    """(name, values, required) when ``schema`` only tests one property against const/enum
    values (and perhaps requires it), else None."""
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - ANNOTATIONS
    properties = schema.get("properties")
    if not keys <= {"properties", "required"} or not isinstance(properties, dict):
        return None
    if len(properties) != 1:
        return None
    ((name, check),) = properties.items()
    required = schema.get("required") or []
    if (
        not isinstance(check, dict)
        or set(check) - ANNOTATIONS - {"const", "enum"}
        or required not in ([], [name])
    ):
        return None
    values = listed_values(check)
    return None if values is None else (name, values, bool(required))


def listed_values(schema: dict[str, Any]) -> list[Any] | None:
    """The values ``schema`` lists: its ``const``, or its ``enum`` list; None when it lists
    none."""
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if isinstance(schema.get("enum"), list) else None


def finite_values(schema: Any) -> list[Any] | None:
    """The values a property schema allows when they are few and listed: enum, const or
    boolean; None otherwise."""
    if not isinstance(schema, dict):
        return None
    values = listed_values(schema)
    if values is None and schema.get("type") == "boolean" and set(schema) - ANNOTATIONS == {"type"}:
        return [True, False]
    return values


def expand_dependencies(sub: Schema, pointer: str) -> Schema:
    """``dependentRequired`` (and draft 4-7 ``dependencies`` with property lists) as an exact
    ``anyOf``: for each trigger property that may be absent, objects without it, or with it
    and its dependencies. Exact where objects hold only their declared properties (no
    ``additionalProperties`` or ``patternProperties``, which could bring the trigger back);
    otherwise the keyword stays, and the checker refuses it."""
    if not isinstance(sub, dict):
        return sub
    deps: dict[str, list[str]] = {}
    for key in ("dependentRequired", "dependencies"):
        value = sub.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
            return sub  # schema-valued dependencies are not rewritten
        for name, needed in value.items():
            deps.setdefault(name, []).extend(needed)
    if not deps:
        return sub
    if sub.get("additionalProperties", False) is not False or "patternProperties" in sub:
        return sub
    base = {k: v for k, v in sub.items() if k not in ("dependentRequired", "dependencies")}
    properties = base.get("properties") or {}
    required = list(base.get("required") or ())
    branches: list[dict[str, Any]] = [base]
    for trigger, needed in deps.items():
        if trigger not in properties:
            continue  # strict objects never hold it: the dependency never applies
        grown: list[dict[str, Any]] = []
        for branch in branches:
            branch_required = list(branch.get("required") or required)
            branch_props = branch.get("properties") or {}
            if trigger not in branch_props:
                grown.append(branch)  # this branch already excludes the trigger
                continue
            with_it = {
                **branch,
                "required": list(dict.fromkeys([*branch_required, trigger, *needed])),
            }
            grown.append(with_it)
            if trigger not in branch_required:
                without = {
                    **branch,
                    "properties": {k: v for k, v in branch_props.items() if k != trigger},
                }
                grown.append(without)
        branches = grown
        if len(branches) > MAX_BRANCHES:
            raise UnsupportedSchemaFeature(
                "dependentRequired", pointer, f"its expansion makes over {MAX_BRANCHES} branches"
            )
    # A branch requiring a property another trigger's branch removed holds no object.
    branches = [
        b for b in branches if set(b.get("required") or ()) <= set(b.get("properties") or {})
    ]
    if not branches:
        return sub  # no branch holds an object: the checker refuses it as it stands
    if len(branches) == 1:
        return branches[0]
    keep = {k: v for k, v in base.items() if k in ANNOTATIONS or k in DEFS}
    return {**keep, "anyOf": [{k: v for k, v in b.items() if k not in keep} for b in branches]}


def canonical(value: Any) -> str:
    """Equal JSON values (1 and 1.0 included) give equal strings; booleans stay apart."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        items = sorted(value.items())
        return "{" + ",".join(f"{json.dumps(k)}:{canonical(v)}" for k, v in items) + "}"
    return f"{type(value).__name__ if isinstance(value, bool) else ''}{json.dumps(value)}"

"""Where subschemas live inside a JSON schema, and JSON pointers to them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# Keywords whose value is one subschema, a map of name -> subschema, or a list of subschemas.
SINGLE = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
)
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def is_old_draft(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` declares draft 3 to 7, whose ``$ref`` makes its siblings ignored."""
    declared = str(schema.get("$schema", ""))
    return any(draft in declared for draft in ("draft-03", "draft-04", "draft-06", "draft-07"))


def escape_pointer(token: str) -> str:
    """One JSON-pointer reference token (RFC 6901): ``~`` -> ``~0``, ``/`` -> ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")


def iter_subschemas(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object subschema, the root first, as (JSON pointer, subschema); booleans skipped.

    The subschemas are the schema's own objects, so callers may modify them in place.
    """
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key in SINGLE:
        yield from iter_subschemas(schema.get(key), f"{pointer}/{key}")
    items = schema.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield from iter_subschemas(sub, f"{pointer}/items/{i}")
    else:
        yield from iter_subschemas(items, f"{pointer}/items")
    for key in MAPS:
        mapping = schema.get(key)
        if isinstance(mapping, dict):
            for name, sub in mapping.items():
                yield from iter_subschemas(sub, f"{pointer}/{key}/{escape_pointer(name)}")
    dependencies = schema.get("dependencies")
    if isinstance(dependencies, dict):
        for name, sub in dependencies.items():
            yield from iter_subschemas(sub, f"{pointer}/dependencies/{escape_pointer(name)}")
    for key in LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                yield from iter_subschemas(sub, f"{pointer}/{key}/{i}")


def resolve_local_ref(root: dict[str, Any], ref: str) -> Any:
    """The value a local ``$ref`` ("#" or "#/a/b") points to in ``root``; KeyError if none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise KeyError(ref)
    node: Any = root
    for token in unquote(ref[2:]).split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(token)] if isinstance(node, list) else node[token]
        except (IndexError, ValueError, TypeError):
            raise KeyError(ref) from None
    return node


def prune_unused_definitions(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without the root ``$defs``/``definitions`` entries that no reference reachable
    from the root leads to (they cannot shape any value, so their features must not refuse the
    schema); the schema itself when all are used."""
    pools = {
        key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)
    }
    if not pools:
        return schema
    kept: dict[str, set[str]] = {key: set() for key in pools}
    root = {k: v for k, v in schema.items() if k not in pools}
    if is_old_draft(schema) and isinstance(root.get("$ref"), str):
        root = {"$ref": root["$ref"]}  # drafts 4-7 ignore a reference's siblings
    pending: list[Any] = [root]
    while pending:
        refs = {
            unquote(sub["$ref"])
            for node in pending
            for _, sub in iter_subschemas(node)
            if isinstance(sub.get("$ref"), str)
        }
        pending = []
        for key, pool in pools.items():
            for name in pool:
                target = f"#/{key}/{escape_pointer(name)}"
                if name not in kept[key] and any(
                    r == target or r.startswith(target + "/") for r in refs
                ):
                    kept[key].add(name)
                    pending.append(pool[name])
    if all(len(kept[key]) == len(pool) for key, pool in pools.items()):
        return schema
    pruned = dict(schema)
    for key, pool in pools.items():
        pruned[key] = {name: sub for name, sub in pool.items() if name in kept[key]}
    return pruned

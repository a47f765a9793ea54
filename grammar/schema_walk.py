"""Where subschemas live inside a JSON schema, and JSON pointers to them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


def entry_pointer(pointer: str, key: str, name: str) -> str:
    """The JSON pointer of the subschema ``name`` of the map ``key`` in the subschema at
    ``pointer``. The root table of reference targets (``schema_refs.hoist_refs``) names each
    entry by its pointer in the schema as written, which is what messages must show."""
    if not pointer and key in ("$defs", "definitions") and name.startswith("/"):
        return name
    return f"{pointer}/{key}/{escape_pointer(name)}"


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
                yield from iter_subschemas(sub, entry_pointer(pointer, key, name))
    dependencies = schema.get("dependencies")
    if isinstance(dependencies, dict):
        for name, sub in dependencies.items():
            yield from iter_subschemas(sub, f"{pointer}/dependencies/{escape_pointer(name)}")
    for key in LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                yield from iter_subschemas(sub, f"{pointer}/{key}/{i}")

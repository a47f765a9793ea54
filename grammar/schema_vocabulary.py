"""Keywords as the schema's own draft reads them.

The passes after this one read every keyword as draft 2020-12 does. Drafts differ: draft 4
has no ``const`` (so ``{"oneOf": [{"const": true}, {"enum": [-3]}]}`` admits -3 twice, and
fails ``oneOf``, under a draft 4 validator), draft 7 ignores ``dependentRequired`` and 2020-12
ignores ``dependencies``; a keyword a draft does not define only annotates there. Read with a
later draft's meaning it narrows a subschema, which is harmless alone but not inside ``oneOf``,
whose disjointness then holds for the narrowed branches only. So each subschema keeps the
keywords its draft's validator (``jsonschema``) evaluates, plus annotations; draft 4's boolean
``exclusiveMinimum``/``exclusiveMaximum`` become the numeric bounds of later drafts. Draft 3
(``required`` inside properties, ``extends``, ``disallow``, ``divisibleBy``) is refused.
"""

from __future__ import annotations

from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.errors import UnsupportedSchemaFeature
from grammar.schema_rewrite import ANNOTATIONS, DEFS
from grammar.schema_walk import iter_subschemas

# Keywords a draft's validator evaluates inside another one's (``then`` in ``if``...).
_INSIDE = {
    "if": ("then", "else"),
    "contains": ("minContains", "maxContains"),
    "maximum": ("exclusiveMaximum",),
    "minimum": ("exclusiveMinimum",),
}


def read_as_own_draft(schema: dict[str, Any], best_effort: bool) -> None:
    """Drop, in place, every keyword of every subschema of a hoisted ``schema`` that its
    declared draft does not evaluate (2020-12 when it declares none), and write draft 4's
    boolean exclusive bounds as numbers. Run after the metaschema check (draft 4's metaschema
    wants the booleans). UnsupportedSchemaFeature for draft 3, unless ``best_effort``."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    evaluated = set(cls.VALIDATORS)
    if cls is jsonschema.Draft3Validator and not best_effort:
        raise UnsupportedSchemaFeature(
            "$schema", "", "draft 3 is not supported (its 'required', 'extends', 'disallow' and "
            "'divisibleBy' are not enforced); declare draft 4 or later",
        )  # fmt: skip
    kept = evaluated | ANNOTATIONS | set(DEFS) | {"$schema"}
    for outer, inner in _INSIDE.items():
        if outer in evaluated:
            kept |= set(inner)
    boolean_bounds = cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator)
    for _, sub in iter_subschemas(schema):
        if boolean_bounds:
            _numeric_bounds(sub)
        for key in [key for key in sub if key not in kept]:
            del sub[key]


def _numeric_bounds(sub: dict[str, Any]) -> None:
    """Draft 4's ``{"maximum": 5, "exclusiveMaximum": true}`` as ``{"exclusiveMaximum": 5}``."""
    for bound, exclusive in (("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")):
        flag = sub.pop(exclusive, False)
        if flag is True and bound in sub:
            sub[exclusive] = sub.pop(bound)

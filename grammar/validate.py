"""Validate-and-retry's check: does a finished output satisfy the schema it was asked for?

Where a schema keyword has no exact automaton (``not``, general ``uniqueItems``, ``contains``
counts, formats without one, ...), ``strict_mode: "validate"`` compiles the enforceable part
(best effort: a superset of the schema's language) and checks each finished output here, with
the ``jsonschema`` validator of the schema's own draft, formats asserted; the runtime draws
again until one passes or its attempts run out, so an output that breaks the schema is never
returned as valid.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from referencing.exceptions import Unresolvable

# A reason longer than this is cut: it ends in an error message, not a report.
_MAX_REASON = 300


def output_validator(schema: dict[str, Any] | str) -> Callable[[str], str | None]:
    """A check of an output's text against ``schema`` (a dict or its JSON text): None when
    the text is one JSON value that validates, else the reason, naming the JSON pointer of
    the first failing value. Raises ValueError for a schema that is not valid JSON; the check
    raises ValueError when the validator cannot evaluate the schema for this value (a
    reference it cannot resolve, such as a ``$dynamicRef`` to an anchor it lacks)."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"the output is not one JSON value ({exc})"
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        except (jsonschema.exceptions.SchemaError, Unresolvable, LookupError, ValueError) as exc:
            raise ValueError(f"the schema cannot be checked: {exc}") from None
        if error is None:
            return None
        pointer = "".join(f"/{part}" for part in error.absolute_path) or "/"
        reason = f"the value at {pointer} breaks '{error.validator}': {error.message}"
        return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."

    return check

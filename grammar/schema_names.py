"""Object keys made exact: ``propertyNames``, and ``patternProperties`` keys that could repeat a
declared property.

Measured on xgrammar 0.2.8:

- ``propertyNames`` keys may repeat a declared property (``{"a":true,"a":1}`` for a boolean
  ``a`` and names ``enum: [a, b]``), admit raw control characters when length-bounded, and
  lose characters of patterns (its JSON-string regex mode); and our own split of a typeless
  names schema by type made keys of every JSON type (``{[" "]:2}``, not JSON);
- a ``patternProperties`` key may spell a declared property's name again (``{"ab":3,"ab":77}``
  for ``properties: {ab: {maximum: 5}}`` and pattern ``^a[a-c]$``): the last value wins, and
  it need not satisfy the declared schema. (Keys for ``additionalProperties`` do exclude the
  declared names.) And a key written for one pattern may match another, whose schema its
  value must satisfy too (``{"y":",#"}`` for patterns ``^[xy]$``: integer, ``^[yz]$``: string).

So keys are planned here. ``propertyNames`` (a string schema: ``pattern``, a format we write as
a pattern, lengths, ``enum``/``const``; behind ``$ref``s) becomes an automaton; each
``patternProperties`` pattern is intersected with it; ``additionalProperties: S`` beside it
(without patterns) becomes the one pattern entry "names: S" with ``additionalProperties:
false``; declared properties the names reject are left out (objects hold no undeclared keys),
and a required one leaves no object. Pattern keys exclude the declared names they could spell.
A pattern's keys also exclude every key another pattern with a different schema matches
(decided on a superset of Python's ``re`` language: ``\\d``, ``\\w``, ``\\s`` as any character).
Whatever has no exact plan raises ``KeysUnsupported`` (the checker refuses it by keyword).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.automaton import AutomatonTooLarge, Dfa, difference, intersection, union
from grammar.errors import GrammarError
from grammar.regex_automaton import any_string_dfa, literals_dfa
from grammar.schema_formats import FORMAT_PATTERNS, STANDARD_FORMATS
from grammar.schema_lengths import (
    MAX_STRING_STATES,
    StringTooComplex,
    pattern_automaton,
    string_dfa,
    string_patterns,
)
from grammar.schema_refs import MAX_REF_HOPS, resolve_ref
from grammar.schema_rewrite import ANNOTATIONS, DEFS

_NAME_KEYWORDS = frozenset(
    {"type", "pattern", "format", "minLength", "maxLength", "enum", "const", "$ref"}
)
_EMPTY = Dfa(frozenset(), ((),))


class KeysUnsupported(Exception):
    """No exact plan for an object's keys: ``keyword`` and ``reason`` say why."""

    def __init__(self, keyword: str, reason: str) -> None:
        super().__init__(reason)
        self.keyword = keyword
        self.reason = reason


@dataclass
class KeyPlan:
    """How to lower one object's keys. ``patterns`` replaces ``patternProperties``: (regex,
    value) entries keep a pattern as it is, (automaton, value) ones get an exact key rule;
    ``dropped``: declared properties to leave out; ``closed``: set additionalProperties false."""

    patterns: list[tuple[str | Dfa, Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    closed: bool = False


def plan_keys(root: dict[str, Any], sub: dict[str, Any], pointer: str) -> KeyPlan | None:
    """The key plan of object schema ``sub`` (None when the backend's keys are exact as they
    stand). Raises KeysUnsupported, or GrammarError when no object can be written."""
    found = sub.get("properties")
    declared: dict[str, Any] = found if isinstance(found, dict) else {}
    found = sub.get("patternProperties")
    patterns: dict[str, Any] = found if isinstance(found, dict) else {}
    has_names = "propertyNames" in sub
    names = _names_dfa(root, sub["propertyNames"], 0) if has_names else None
    plan = KeyPlan()
    if has_names:
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        check = cls(root, format_checker=cls.FORMAT_CHECKER).evolve(schema=sub["propertyNames"])
        required = set(sub.get("required") or ())
        for name in declared:
            if not check.is_valid(name):
                if name in required:
                    raise GrammarError(
                        f"JSON schema at {pointer or '/'} admits no object: required property "
                        f"{name!r} breaks its propertyNames"
                    )
                plan.dropped.append(name)
    kept = [name for name in declared if name not in plan.dropped]
    banned = [p for p, v in patterns.items() if v is False]  # keys that may not appear
    changed = has_names or bool(banned)
    for pattern, value in patterns.items():
        if value is False:
            continue  # strict objects write no key for it; the others keep out of it below
        spelled = [name for name in kept if _fullmatches(pattern, name)]
        # A key another pattern also matches must satisfy that pattern's schema too.
        others = [p for p, v in patterns.items() if p != pattern and v not in (True, {}, value)]
        if names is None and not spelled and not others:
            plan.patterns.append((pattern, value))
            continue
        changed = True
        dfa = _automaton(lambda p=pattern: pattern_automaton(p, search=True), "patternProperties")
        if names is not None:
            dfa = _automaton(lambda d=dfa: _meet(d, names), "propertyNames")
        dfa = _without(_outside(dfa, others), kept, "patternProperties")
        if dfa.finals:  # else no key can take this pattern: it adds nothing
            plan.patterns.append((dfa, value))
    extra = sub.get("additionalProperties", False)
    unwritable = any(value is False for value in declared.values())
    if (has_names or banned or unwritable) and len(banned) == len(patterns) and extra is not False:
        changed = True
        # Additional keys become one pattern entry: the names allowed, outside the banned
        # patterns, other than the declared names, false ones included (the backend's
        # additional keys avoid only the declared names it writes).
        dfa = _outside(names if names is not None else any_string_dfa(), banned)
        dfa = _without(dfa, kept, "propertyNames" if has_names else "patternProperties")
        if dfa.finals:
            plan.patterns.append((dfa, extra))
        plan.closed = True
    return plan if changed else None


def _outside(dfa: Dfa, patterns: list[str]) -> Dfa:
    """``dfa`` without every string in which Python's ``re`` finds one of ``patterns`` (their
    wide automata: a superset, so nothing they match stays)."""
    for pattern in patterns:
        wide = _automaton(lambda p=pattern: pattern_automaton(p, True, True), "patternProperties")
        dfa = _automaton(lambda d=dfa, w=wide: _minus(d, w), "patternProperties")
    return dfa


def _names_dfa(root: dict[str, Any], names: Any, hops: int) -> Dfa | None:
    """The automaton of the key names ``names`` allows (None: any string)."""
    if names is True or names == {}:
        return None
    if names is False:
        return _EMPTY
    if not isinstance(names, dict):
        raise KeysUnsupported("propertyNames", "it must be a schema")
    if isinstance(names.get("$ref"), str):
        if hops >= MAX_REF_HOPS or set(names) - ANNOTATIONS - {"$ref"} - set(DEFS):
            raise KeysUnsupported("propertyNames", "a reference beside other keywords")
        return _names_dfa(root, resolve_ref(root, names["$ref"]).schema, hops + 1)
    if isinstance(names.get("anyOf"), list) and not set(names) - ANNOTATIONS - {"anyOf"}:
        # A typeless name schema becomes a union by type: only its string branches name keys.
        union = _EMPTY
        for branch in names["anyOf"]:
            found = _names_dfa(root, branch, hops + 1)
            if found is None:
                return None
            union = _automaton(lambda u=union, f=found: _join(u, f), "propertyNames")
        return union
    unknown = set(names) - ANNOTATIONS - _NAME_KEYWORDS - set(DEFS)
    if unknown:
        keyword = sorted(unknown)[0]
        raise KeysUnsupported("propertyNames", f"'{keyword}' in propertyNames is not enforced")
    types = names.get("type", "string")
    if "string" not in ([types] if isinstance(types, str) else types):
        return _EMPTY
    if "const" in names or "enum" in names:
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        check = cls(root, format_checker=cls.FORMAT_CHECKER).evolve(schema=names)
        values = [names["const"]] if "const" in names else list(names["enum"])
        allowed = [v for v in values if isinstance(v, str) and check.is_valid(v)]
        return _automaton(lambda: literals_dfa(allowed, MAX_STRING_STATES), "propertyNames")
    fmt = names.get("format")
    if fmt in STANDARD_FORMATS and fmt not in FORMAT_PATTERNS:
        raise KeysUnsupported("propertyNames", f"format {fmt!r} in propertyNames is not enforced")
    low, high = names.get("minLength", 0), names.get("maxLength")
    patterns = tuple(string_patterns(names))
    if not patterns and not low and high is None:
        return None
    try:
        return string_dfa(patterns, low, high)
    except GrammarError:
        return _EMPTY  # no name qualifies: objects hold only keys that need none
    except StringTooComplex as exc:
        raise KeysUnsupported("propertyNames", str(exc)) from None


def _meet(a: Dfa, b: Dfa) -> Dfa:
    return intersection(a, b, MAX_STRING_STATES)


def _minus(a: Dfa, b: Dfa) -> Dfa:
    return difference(a, b, MAX_STRING_STATES)


def _join(a: Dfa, b: Dfa) -> Dfa:
    return union(a, b, MAX_STRING_STATES)


def _without(dfa: Dfa, names: list[str], keyword: str) -> Dfa:
    if not names:
        return dfa
    spelled = _automaton(lambda: literals_dfa(names, MAX_STRING_STATES), keyword)
    return _automaton(lambda: _minus(dfa, spelled), keyword)


def _automaton(make: Any, keyword: str) -> Dfa:
    try:
        return make()  # type: ignore[no-any-return]
    except (AutomatonTooLarge, StringTooComplex) as exc:
        raise KeysUnsupported(keyword, f"the automaton of its keys is too large ({exc})") from None
    except GrammarError as exc:
        raise KeysUnsupported(keyword, str(exc)) from None


def _fullmatches(pattern: str, name: str) -> bool:
    """Whether ``name`` fullmatches ``pattern`` in Python (a superset of the keys the backend
    writes for the pattern as it stands)."""
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        reason = f"pattern {pattern!r} is not a valid regex"
        raise KeysUnsupported("patternProperties", reason) from None

"""String formats: which ones constrained JSON enforces, and how.

Measured on xgrammar 0.2.8 (see docs/grammar.md): its grammars for ``uuid``, ``email``,
``ipv6``, ``uri``, ``uri-reference`` and ``duration`` only produce conforming strings, so they
are used as they are. Its ``date`` and ``date-time`` allow day 31 in every month and February
30/31, ``time``/``date-time`` allow second 60 and unbounded fractions, and ``ipv4`` allows
leading zeros ("01.2.3.4"), which validators reject: those formats are rewritten here into
exact patterns (years 0001-9999, leap days only in leap years, seconds 00-59, at most six
fraction digits, upper-case T and Z) whose every string is valid. Every other format is
rejected: xgrammar ignores ``hostname``'s label length limits, emits raw quotes and control
characters for ``json-pointer`` and ``relative-json-pointer``, and treats ``idn-*``, ``iri*``,
``regex`` and ``uri-template`` as unconstrained strings. Formats the specification does not
define are annotations: accepted, and the string left unconstrained.
"""

from __future__ import annotations

_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_OFFSET = "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_TIME = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{{1,6}})?{_OFFSET}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"

# Formats enforced by an exact pattern of ours (the pattern replaces the format keyword).
FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^{_OCTET}(?:\\.{_OCTET}){{3}}$",
}

# Formats xgrammar enforces correctly by itself.
NATIVE_FORMATS = frozenset({"uuid", "email", "ipv6", "uri", "uri-reference", "duration"})

SUPPORTED_FORMATS = frozenset(FORMAT_PATTERNS) | NATIVE_FORMATS

# Every format the JSON Schema specification (2020-12) defines. Others (``int32``, ``color``,
# ``utc-millisec``...) are annotations by the specification: accepted as unconstrained
# strings. Defined ones outside SUPPORTED_FORMATS are refused (they would be weakened).
STANDARD_FORMATS = frozenset(
    {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
     "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
     "json-pointer", "relative-json-pointer", "regex"}
)  # fmt: skip

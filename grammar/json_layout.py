"""The aligned JSON layout: the whitespace a JSON pretty-printer writes, and no more.

Models learnt JSON as pretty-printers write it (``{\\n  "name": "Maria",\\n  "age": 34\\n}``);
forcing compact JSON puts them on token sequences they rarely saw, and they answer worse. The
aligned layout lets the model choose, at each place a pretty-printer may put whitespace:

- after ``{``, ``[`` and ``,``, and before ``}`` and ``]``: nothing, one space, or a newline
  followed by at most ``INDENT_MAX`` spaces or tabs (``arbor_json_ws``);
- after ``:``: nothing or one space (``arbor_json_space``);
- before ``,`` and ``:``: nothing.

Compact JSON is one of the layouts it allows, and every run is bounded, so a model cannot loop
on whitespace. ``INDENT_MAX`` was chosen by measurement (docs/grammar.md).

It is made from the grammar xgrammar prints for ``any_whitespace`` with runs of at most one
character: there every place whitespace may go is a reference to a rule of its own whose body
is one optional whitespace character. Each reference is replaced by the rule its neighbours
call for; whitespace the printed grammar holds in any other form could not be bounded this way,
and ``AlignmentUnavailable`` says so (the caller then writes compact JSON and notes why).
"""

from __future__ import annotations

import re

from grammar.errors import GrammarError

# The longest indentation after a newline: 20 is llama.cpp's bound too, and nests objects 10
# levels deep at an indent of 2 (5 at 4); measured on SmolLM2-135M-Instruct (docs/grammar.md).
INDENT_MAX = 20
# The backend's converter style whose whitespace this module rewrites.
BACKEND_STYLE = {"any_whitespace": True, "max_whitespace_cnt": 1}
WS_RULE = "arbor_json_ws"
SPACE_RULE = "arbor_json_space"
_WS_BODY = '("" | ([ \\n\\r\\t]))'
_WS_CLASS = "[ \\n\\r\\t]"
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
# A quoted literal, a character class, a rule name, or any other one character.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\S')
_NO_SPACE_BEFORE = ('","', '":"')
_REPEAT = ("{", "*", "+", "?")


class AlignmentUnavailable(GrammarError):
    """The grammar holds whitespace the aligned layout cannot bound; ``reason`` says where."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"json_format aligned is not available for this schema: {reason}")
        self.reason = reason


def aligned_rules(indent_max: int = INDENT_MAX) -> list[str]:
    """The two whitespace rules of the aligned layout."""
    return [
        f'{WS_RULE} ::= "" | " " | "\\n" [ \\t]{{0,{indent_max}}}',
        f'{SPACE_RULE} ::= "" | " "',
    ]


def align_whitespace(
    ebnf: str, extra_whitespace: frozenset[str] = frozenset(), indent_max: int = INDENT_MAX
) -> str:
    """``ebnf`` (printed by the backend in ``BACKEND_STYLE``, perhaps with rules of ours
    spliced in that write ``extra_whitespace`` names for whitespace) in the aligned layout.

    Raises AlignmentUnavailable when some whitespace is not in the form described above."""
    lines = ebnf.splitlines()
    whitespace = set(extra_whitespace)
    for line in lines:
        match = _RULE.match(line)
        if match and match.group(2) == _WS_BODY:
            whitespace.add(match.group(1))
    kept: list[str] = []
    for line in lines:
        match = _RULE.match(line)
        if match is None:
            if line.strip():
                raise AlignmentUnavailable(f"the grammar has a line it cannot read: {line!r}")
            continue
        name, body = match.groups()
        if name in whitespace:
            continue
        kept.append(f"{name} ::= {_align_body(body, whitespace)}")
    return "\n".join([*kept, *aligned_rules(indent_max)])


def _align_body(body: str, whitespace: set[str]) -> str:
    """``body`` with each whitespace reference replaced in place (the rest left as printed)."""
    tokens = list(_TOKEN.finditer(body))
    pieces: list[str] = []
    done = 0
    for i, token in enumerate(tokens):
        text = token.group(0)
        if text == _WS_CLASS:
            raise AlignmentUnavailable("whitespace outside the places a pretty-printer uses")
        if text not in whitespace:
            continue
        after = tokens[i + 1].group(0) if i + 1 < len(tokens) else ""
        before = tokens[i - 1].group(0) if i else ""
        if after in _REPEAT:
            raise AlignmentUnavailable("a repeated whitespace run")
        if after in _NO_SPACE_BEFORE:
            rule = '""'
        elif before == '":"':
            rule = SPACE_RULE
        else:
            rule = WS_RULE
        pieces += [body[done : token.start()], rule]
        done = token.end()
    return "".join([*pieces, body[done:]])

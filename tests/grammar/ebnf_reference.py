"""A test grammar in GBNF form and an independent recursive-descent parser for its language."""

from __future__ import annotations

ARITHMETIC_EBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= "0" | [1-9] [0-9]*
"""


def parse_arithmetic(text: str) -> None:
    """Raise ValueError unless ``text`` is in ARITHMETIC_EBNF's language."""
    parser = _Parser(text)
    parser.expr()
    if parser.pos != len(text):
        raise ValueError(f"trailing text at {parser.pos} in {text!r}")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at {self.pos} in {self.text!r}")
        self.pos += 1

    def expr(self) -> None:
        self.term()
        while self.peek() in ("+", "-") and self.peek():
            self.pos += 1
            self.term()

    def term(self) -> None:
        self.factor()
        while self.peek() in ("*", "/") and self.peek():
            self.pos += 1
            self.factor()

    def factor(self) -> None:
        char = self.peek()
        if char == "(":
            self.pos += 1
            self.expr()
            self.expect(")")
        elif char == "-":
            self.pos += 1
            self.factor()
        elif char == "0":
            self.pos += 1
        elif char and char in "123456789":
            while self.peek() and self.peek() in "0123456789":
                self.pos += 1
        else:
            raise ValueError(f"expected a factor at {self.pos} in {self.text!r}")

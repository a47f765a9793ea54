"""A ReAct-style agent: it thinks, picks a tool with `select`, and the tool is a Python function
whose result is appended as the observation. Every step extends the same conversation, so each
call reuses the cached prefix of all the steps before it."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

import frontend_lang as fl

CITIES = {
    "paris": "Paris is the capital of France; about 2.1 million people live there.",
    "tokyo": "Tokyo is the capital of Japan; about 14 million people live there.",
    "lima": "Lima is the capital of Peru; about 10 million people live there.",
}
_OPERATORS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluate + - * / over numbers; anything else is an error message for the model."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def lookup(query: str) -> str:
    words = query.lower().split()
    hits = [fact for city, fact in CITIES.items() if city in words]
    return " ".join(hits) or f"no entry for {query.strip()!r}"


TOOLS = {"calculator": calculator, "lookup": lookup, "finish": None}


@fl.function
def react_agent(s: fl.ProgramState, question: str, max_steps: int = 3, max_tokens: int = 32):
    s += fl.system(
        "Answer by reasoning step by step. After each thought choose an action: "
        "calculator (arithmetic), lookup (facts about a city) or finish (give the answer)."
    )
    s += fl.user(question)
    with s.assistant():
        for step in range(max_steps):
            s += "Thought: " + fl.gen(f"thought_{step}", max_tokens=max_tokens, stop="\n")
            s += "\nAction: " + fl.select(f"action_{step}", choices=list(TOOLS))
            s += "\nInput: " + fl.gen(f"input_{step}", max_tokens=max_tokens, stop="\n")
            tool = TOOLS[s[f"action_{step}"]]
            if tool is None:
                break
            s += f"\nObservation: {tool(s[f'input_{step}'])}\n"


def main(backend: fl.Backend, max_tokens: int = 32, max_steps: int = 3) -> fl.ProgramState:
    state = react_agent.run(
        question="How many more people live in Tokyo than in Paris?",
        max_steps=max_steps,
        max_tokens=max_tokens,
        backend=backend,
    )
    print(state.messages()[-1]["content"])
    return state


if __name__ == "__main__":
    from _backend import open_backend, parse_args

    arguments = parse_args(__doc__)
    with open_backend(arguments) as chosen:
        main(chosen, arguments.max_tokens)

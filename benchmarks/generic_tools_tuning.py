"""How well a model whose chat template has no tool syntax calls tools: the generic format's
prompt (``runtime.chat.generic_tools``) against the template alone, on the tuning prompts
in ``benchmarks/data/generic_tools_tuning.json`` (tuning data the format was chosen on, not a
frozen evaluation set).

For each prompt, greedy, in two prompt modes — ``template`` (the chat template given the
tools, which a template without tool syntax drops) and ``generic`` (the tools written into the
system turn) — and two tool_choice modes:

- ``auto``: free output, parsed in the format; counts the outputs with a call, with the right
  tool, and with the right arguments;
- ``required``: one call forced by the tool-call grammar; counts the right tool and arguments.

    python -m benchmarks.generic_tools_tuning [--model-path PATH]   (default: the built-in model)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from runtime.chat.generic_tools import generic_messages
from runtime.chat.tool_calls import parse_tool_calls, tool_call_constraint
from runtime.engine import Engine
from runtime.model_files import builtin_model_path

DATA = Path(__file__).parent / "data" / "generic_tools_tuning.json"
MAX_TOKENS = 80


def prompts(tokenizer: Any, data: dict[str, Any], mode: str) -> list[str]:
    """Each item's prompt text under ``mode`` (template or generic)."""
    texts = []
    for item in data["items"]:
        tools = [{"type": "function", "function": data["tools"][n]} for n in item["tools"]]
        messages = [{"role": "user", "content": item["prompt"]}]
        if mode == "generic":
            messages, given = generic_messages(messages, tools), None
        else:
            given = tools
        texts.append(
            tokenizer.apply_chat_template(
                messages, tools=given, add_generation_prompt=True, tokenize=False
            )
        )
    return texts


def score(engine: Engine, data: dict[str, Any], mode: str, choice: str) -> dict[str, Any]:
    items = data["items"]
    params = []
    for item in items:
        sampling: dict[str, Any] = {"temperature": 0, "max_new_tokens": MAX_TOKENS}
        if choice == "required":
            functions = [data["tools"][n] for n in item["tools"]]
            sampling["structural_tag"] = tool_call_constraint(
                functions, "required", parallel=False, fmt="generic"
            )
        params.append(sampling)
    outputs = engine.generate(prompts(engine.tokenizer, data, mode), params)
    called = right_tool = right_args = 0
    for item, output in zip(items, outputs, strict=True):
        _, calls = parse_tool_calls(output["text"], set(item["tools"]), fmt="generic")
        called += bool(calls)
        if calls and calls[0].name == item["name"]:
            right_tool += 1
            right_args += json.loads(calls[0].arguments) == item["arguments"]
    return {
        "prompt": mode,
        "tool_choice": choice,
        "items": len(items),
        "with a call": called,
        "right tool": right_tool,
        "right arguments": right_args,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    engine = Engine(args.model_path or builtin_model_path())
    try:
        rows = [
            score(engine, data, mode, choice)
            for choice in ("auto", "required")
            for mode in ("template", "generic")
        ]
    finally:
        engine.shutdown()
    print_table(list(rows[0]), [list(row.values()) for row in rows])


if __name__ == "__main__":
    main()

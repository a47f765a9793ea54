"""Re-sent tool-calling turns keep the token ids the model generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from runtime.chat.generated_turns import GeneratedTurns
from runtime.ipc import FinishReason
from runtime.tokenizer_manager import RequestOutput

CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _final(output_ids: list[int], reason: FinishReason) -> RequestOutput:
    return RequestOutput("r", "", "", output_ids, 1, len(output_ids), 0, reason, 0.0)


def _spelled_out(tokenizer: Any) -> list[int]:
    """CALL as the model might sample it: the JSON one character per token (not how the
    tokenizer splits it), between the tag tokens."""
    body = CALL[len("<tool_call>") : -len("</tool_call>")]
    chars = [tokenizer(char, add_special_tokens=False).input_ids[0] for char in body]
    tags = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    ids = [tags[0], *chars, tags[1]]
    assert tokenizer.decode(ids) == CALL
    return ids


def _conversation(call_id: str, arguments: str = '{"zone": "UTC"}') -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function"}
    call["function"] = {"name": "get_time", "arguments": arguments}
    return [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "noon"},
    ]


def test_a_resent_turn_takes_the_generated_ids(tokenizer: Any):
    turns = GeneratedTurns(tokenizer)
    prompt = tokenizer.apply_chat_template(
        _conversation("x")[:1], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generated = _spelled_out(tokenizer)
    turns.remember(["call_1"], _final([*generated, im_end], FinishReason.stop(im_end)))
    messages = _conversation("call_1")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = turns.prompt_ids(rendered, messages)
    assert ids[: len(prompt_ids) + len(generated) + 1] == [*prompt_ids, *generated, im_end]
    assert tokenizer.decode(ids) == rendered
    plain = tokenizer(rendered, add_special_tokens=False).input_ids
    assert plain != ids  # the tokenizer alone would have split the call differently
    # Unknown ids, or arguments the client rewrote: the plain tokenization.
    assert turns.prompt_ids(rendered.replace("call_1", "call_2"), _conversation("call_2")) == plain
    edited = _conversation("call_1", '{"zone":"UTC"}')
    text = tokenizer.apply_chat_template(edited, tokenize=False, add_generation_prompt=True)
    assert turns.prompt_ids(text, edited) == tokenizer(text, add_special_tokens=False).input_ids


def test_remembers_a_bounded_number_of_turns(tokenizer: Any):
    turns = GeneratedTurns(tokenizer, capacity=2)
    ids = _spelled_out(tokenizer)
    for call_id in ("a", "b", "c"):
        turns.remember([call_id], _final(ids, FinishReason.cut(len(ids))))
    messages = _conversation("a")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert (
        turns.prompt_ids(rendered, messages)
        == tokenizer(rendered, add_special_tokens=False).input_ids
    )
    messages = _conversation("c")
    assert ids == turns.prompt_ids(CALL, messages)

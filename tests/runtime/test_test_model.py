"""The test-model builder: deterministic, loadable offline, with the tokens chat needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from runtime.test_model import CHAT_TEMPLATES, cached_test_model, make_test_model


def test_same_seed_same_folder_other_seed_other_weights(tmp_path: Path):
    a = make_test_model(tmp_path / "a", "tiny", "qwen2", seed=3)
    b = make_test_model(tmp_path / "b", "tiny", "qwen2", seed=3)
    c = make_test_model(tmp_path / "c", "tiny", "qwen2", seed=4)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all((wa[n] == wb[n]).all() for n in wa)
    assert not (wa["model.embed_tokens.weight"] == wc["model.embed_tokens.weight"]).all()


def test_tokenizer_special_tokens_and_chat_template(tiny_arch_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_arch_model_path)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly


def test_tool_calls_render_in_the_template(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "get_weather" in text.split("<|im_end|>")[0]  # tools listed in the system turn
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text


def test_config_records_the_preset(tiny_arch_model_path: Path):
    meta = json.loads((tiny_arch_model_path / "arbor_test_model.json").read_text())
    config = json.loads((tiny_arch_model_path / "config.json").read_text())
    assert meta["preset"] == "tiny" and config["vocab_size"] == 4096


def test_qwen3_template_thinks_and_keeps_the_default_tokenizer(tiny_model_path: Path):
    from runtime.test_model import cached_test_model

    tok = AutoTokenizer.from_pretrained(cached_test_model("tiny", "qwen3", chat_template="qwen3"))
    think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert len(tok) == 4096 and all(t < 4096 for t in think)
    assert tok("a<think>b</think>c", add_special_tokens=False).input_ids[1::2] == think
    assert tok.decode(think, skip_special_tokens=True) == "<think></think>"  # not special
    default = AutoTokenizer.from_pretrained(tiny_model_path)
    assert "</think>" not in default.get_vocab()  # the default tokenizer is unchanged

    user = [{"role": "user", "content": "Hi"}]
    thinking = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert plain == thinking + "<think>\n\n</think>\n\n"


def test_qwen3_template_keeps_reasoning_only_after_the_last_user_turn():
    from runtime.test_model import cached_test_model

    tok = AutoTokenizer.from_pretrained(cached_test_model("tiny", "qwen3", chat_template="qwen3"))
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nold plan\n</think>\n\nHello"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "new plan",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "old plan" not in text and "<|im_start|>assistant\nHello<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew plan\n</think>\n\n<tool_call>" in text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "2", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": "sunny"},
]
# What each template makes of CONVERSATION's assistant and tool turns.
RENDERED = {
    "llama3": (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city":"Oslo"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
    ),
    "mistral": (
        '[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Oslo"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]<|endoftext|>'
        "[TOOL_RESULTS]sunny[/TOOL_RESULTS]"
    ),
}


@pytest.mark.parametrize("template", ["llama3", "mistral"])
def test_other_chat_templates_render_tools_calls_and_results(template: str):
    path = cached_test_model("tiny", "llama", chat_template=template)
    assert path.name.endswith(f"-{template}") and path != cached_test_model("tiny", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith(tok.bos_token) and RENDERED[template] in text
    assert '"get_weather"' in text.split("Weather?")[0]  # tools come before the user turn
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    config = json.loads((path / "generation_config.json").read_text())
    turn_end = CHAT_TEMPLATES[template].turn_end
    assert tok.convert_tokens_to_ids(turn_end) in config["eos_token_id"]
    # Special tokens vanish from decoded text; tool-call markup does not.
    for token in CHAT_TEMPLATES[template].added_tokens:
        ids = tok(token, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == token
    # The prompt that asked for the calls is a prefix of the conversation that holds them.
    prompt = tok.apply_chat_template(
        CONVERSATION[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith(prompt)


def test_default_template_keeps_its_token_ids(tiny_model_path: Path):
    """The chatml tokenizer's ids are the ones cached models and saved outputs rely on."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    names = ["<|begin_of_text|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    assert tok.convert_tokens_to_ids(names) == [0, 1, 2, 3, 4]
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [4094, 4095]
    assert json.loads((tiny_model_path / "arbor_test_model.json").read_text())["seed"] == 0

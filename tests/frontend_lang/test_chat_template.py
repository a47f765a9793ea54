"""Role headers and footers recovered from tokenizers' chat templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import frontend_lang as fl
from frontend_lang.backends.native import template_or_error
from runtime.test_model import cached_test_model

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_blocks_concatenate_to_the_template_rendering(arch: str, tiny_model_path: Path):
    path = tiny_model_path if arch == "llama" else cached_test_model("tiny", arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = fl.ChatTemplate.from_tokenizer(tokenizer)
    expected = str(tokenizer.apply_chat_template(CONVERSATION, tokenize=False))
    adds_bos = tokenizer("x").input_ids[0] == tokenizer.bos_token_id
    if adds_bos:  # tokenizing the text adds BOS, so the text must not carry it
        assert expected.startswith(tokenizer.bos_token)
        expected = expected[len(tokenizer.bos_token) :]
    assert template.render(CONVERSATION) == expected
    assert template.render(CONVERSATION[1:2]) == template.begin + "<|im_start|>user\nHi<|im_end|>\n"


class FakeTokenizer:
    """A Llama-3-style template whose tokenizer does not add BOS by itself."""

    bos_token = "<|begin_of_text|>"
    bos_token_id = 7
    chat_template = "llama3-like"

    def __init__(self, rewrite_history: bool = False) -> None:
        self.rewrite_history = rewrite_history

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        parts = [self.bos_token]
        for i, m in enumerate(messages):
            content = m["content"]
            if self.rewrite_history and m["role"] == "assistant" and i < len(messages) - 1:
                content = "[earlier answer]"
            parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{content}<|eot_id|>")
        return "".join(parts)

    def __call__(self, text: str) -> Any:
        class Encoding:
            input_ids = [99]

        return Encoding()


def test_bos_text_is_kept_when_the_tokenizer_does_not_add_it():
    template = fl.ChatTemplate.from_tokenizer(FakeTokenizer())
    assert template.begin == "<|begin_of_text|>"
    assert template.prefix["user"] == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert template.suffix["assistant"] == "<|eot_id|>"
    assert template.render(CONVERSATION) == FakeTokenizer().apply_chat_template(CONVERSATION)


def test_templates_that_are_not_block_concatenations_are_refused():
    with pytest.raises(fl.ChatTemplateError, match="each message's content once"):
        fl.ChatTemplate.from_tokenizer(FakeTokenizer(rewrite_history=True))

    class NoTemplate:
        chat_template = None

    with pytest.raises(fl.ChatTemplateError, match="chat_template=fl.CHATML"):
        template_or_error(lambda: fl.ChatTemplate.from_tokenizer(NoTemplate()))


def test_engine_backends_take_role_blocks_from_the_engine_or_its_tokenizer(
    engine_backend: fl.Engine,
):
    from frontend_lang.backends.native import NativeBackend

    tokenizer = engine_backend.engine.tokenizer
    expected = fl.ChatTemplate.from_tokenizer(tokenizer)
    assert engine_backend.engine.role_blocks() is engine_backend.engine.role_blocks()  # cached

    class TokenizerOnly:  # an engine-like object (the benchmarks' HTTP engine is one)
        pass

    like = TokenizerOnly()
    like.tokenizer = tokenizer  # type: ignore[attr-defined]
    backend = fl.Engine.__new__(fl.Engine)
    NativeBackend.__init__(backend, None)
    backend.engine = like  # type: ignore[assignment]
    assert backend.chat_template == expected
    fresh = fl.Engine.__new__(fl.Engine)
    NativeBackend.__init__(fresh, None)
    fresh.engine = engine_backend.engine
    assert fresh.chat_template == expected

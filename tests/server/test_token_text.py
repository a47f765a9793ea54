"""Token text and bytes for logprobs."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from runtime.server.token_text import TokenText


def test_token_bytes_rebuild_multibyte_text(tiny_model_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    text = "naïve café 中文 🙂 <tool_call>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    token_text = TokenText(tokenizer)
    assert b"".join(token_text.token_bytes(i) for i in ids).decode() == text
    assert token_text.text(tokenizer.eos_token_id) == tokenizer.eos_token

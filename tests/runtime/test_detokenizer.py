"""Incremental detokenization: UTF-8 safe, spacing right for byte-level BPE and SentencePiece."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from runtime.detokenizer import DetokenizerManager
from runtime.ipc import FinishReason, TokenOutput, TokenOutputBatch

TEXT = "Hello wörld — naïve café 中文字符 🙂 done.\n  indented"


def _stream(
    tokenizer,
    ids: list[int],
    step: int,
    stop: tuple[str, ...] = (),
    context: list[int] | None = None,
) -> list[str]:
    manager = DetokenizerManager(tokenizer)
    deltas = []
    for start in range(0, len(ids), step):
        last = start + step >= len(ids)
        out = TokenOutput(
            rid="r",
            new_token_ids=ids[start : start + step],
            finished_reason=FinishReason.cut(start + step) if last else None,
            prompt_tokens=1,
            completion_tokens=start + step,
            cached_tokens=0,
            stop=stop,
            prompt_tail_ids=context if start == 0 else None,
        )
        deltas.append(manager.process(TokenOutputBatch([out])).outputs[0].text_delta)
    return deltas


def test_byte_level_bpe_streams_whole_characters(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    for step in (1, 2, 3):
        deltas = _stream(tok, ids, step)
        assert "".join(deltas) == TEXT
        assert all("\ufffd" not in d for d in deltas)


def test_stop_string_prefix_is_held_back():
    tok = _sentencepiece_like()
    ids = tok("the cat sat on the mat", add_special_tokens=False).input_ids
    deltas = _stream(tok, ids, 1, stop=("on the rug",))
    # "on" and then "on the" could begin the stop string, so they wait until "mat" rules it out.
    assert deltas == ["the", " cat", " sat", " ", "", "on the mat"]


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with SentencePiece's metaspace convention ("▁" marks a space)."""
    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "the", "cat", "[UNK]"]
    model = models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_sentencepiece_spaces_survive_token_by_token_decoding():
    tok = _sentencepiece_like()
    prompt = tok("the cat", add_special_tokens=False).input_ids
    output = tok("the cat sat on the mat", add_special_tokens=False).input_ids[2:]
    # Decoded alone, "▁sat" loses its leading space; with the prompt as context it keeps it.
    assert "".join(_stream(tok, output, 1, context=prompt)) == " sat on the mat"

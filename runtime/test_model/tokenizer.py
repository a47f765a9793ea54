"""A byte-level BPE tokenizer with special tokens and a chat template (``chat_templates``).

The pre-tokenizer is Qwen2's split regex followed by a regex-free ByteLevel step: transformers
rebuilds exactly that pre-tokenizer for ``model_type: qwen2`` folders, so ids are the same
whichever architecture the folder declares.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from runtime.test_model.chat_templates import BOS, EOS, PAD, get_chat_template
from runtime.test_model.corpus import training_texts

_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(
    vocab_size: int, seed: int, add_bos: bool, chat_template: str = "chatml"
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` entries (special tokens included) on stdlib text.

    ``add_bos`` makes encoding prepend BOS (as Llama 3 tokenizers do); the chat template then
    writes BOS itself and callers tokenize templated text with ``add_special_tokens=False``.
    ``chat_template`` names a ``CHAT_TEMPLATES`` entry; its tokens take the first ids after
    BOS, EOS and PAD (special) and the last ids (added), so chatml's ids never move.
    """
    template = get_chat_template(chat_template)
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(template.added_tokens),
        special_tokens=[BOS, EOS, PAD, *template.special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Enough text that the merges do not run out before the vocabulary is full.
    max_bytes = max(2_000_000, vocab_size * 400)
    tok.train_from_iterator(training_texts(seed, max_bytes), trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS} $B",
            special_tokens=[(BOS, tok.token_to_id(BOS))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens(list(template.added_tokens))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(template.special_tokens),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    wrapped.chat_template = template.template.replace("add_bos", "true" if add_bos else "false")
    return wrapped

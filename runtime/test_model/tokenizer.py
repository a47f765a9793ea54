"""A byte-level BPE tokenizer with special tokens and a chat template chosen by name.

``CHAT_TEMPLATES``: "chatml" (the default) and "qwen3" (ChatML with Qwen3's thinking:
``<think>``/``</think>`` are added tokens of that tokenizer only, so the default tokenizer and
its ids stay as they are).

The pre-tokenizer is Qwen2's split regex followed by a regex-free ByteLevel step: transformers
rebuilds exactly that pre-tokenizer for ``model_type: qwen2`` folders, so ids are the same
whichever architecture the folder declares.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from runtime.test_model.corpus import training_texts

BOS = "<|begin_of_text|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
# Tool-call delimiters are ordinary added tokens (not special): they must survive decoding.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
THINK_START = "<think>"
THINK_END = "</think>"

_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if add_bos %}{{ bos_token }}{% endif %}"
    "{%- set msgs = messages %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- set msgs = messages[1:] %}"
    "{%- endif %}"
    '{{- \'You may call these tools. Each call is a JSON object with "name" and "arguments", '
    "written between <tool_call> and </tool_call>:\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in msgs %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.get('content') %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatML plus Qwen3's thinking: the generation prompt stays open for the model's own
# <think>...</think> unless ``enable_thinking=False``, which writes an empty block so the
# output is all answer; an assistant turn's reasoning (``reasoning_content``, or a
# <think> block in its content) is kept only after the last user message, as Qwen3 does
# for tool loops, and stripped from earlier turns.
QWEN3_CHAT_TEMPLATE = (
    "{%- if add_bos %}{{ bos_token }}{% endif %}"
    "{%- set msgs = messages %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- set msgs = messages[1:] %}"
    "{%- endif %}"
    '{{- \'You may call these tools. Each call is a JSON object with "name" and "arguments", '
    "written between <tool_call> and </tool_call>:\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in msgs %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in msgs %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message.get('content') or '' %}"
    "{%- set reasoning = message.get('reasoning_content') or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and reasoning %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Template name -> (template, the added tokens it needs beyond TOOL_TOKENS).
CHAT_TEMPLATES: dict[str, tuple[str, list[str]]] = {
    "chatml": (CHAT_TEMPLATE, []),
    "qwen3": (QWEN3_CHAT_TEMPLATE, [THINK_START, THINK_END]),
}
CHAT_TEMPLATE_NAMES = tuple(CHAT_TEMPLATES)


def train_tokenizer(
    vocab_size: int, seed: int, add_bos: bool, chat_template: str = "chatml"
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` entries (special tokens included) on stdlib text,
    with the chat template named ``chat_template`` (a key of CHAT_TEMPLATES).

    ``add_bos`` makes encoding prepend BOS (as Llama 3 tokenizers do); the chat template then
    writes BOS itself and callers tokenize templated text with ``add_special_tokens=False``.
    """
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(
            f"unknown chat template {chat_template!r}; choose one of {', '.join(CHAT_TEMPLATES)}"
        )
    template, template_tokens = CHAT_TEMPLATES[chat_template]
    added = TOOL_TOKENS + template_tokens
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=SPECIAL_TOKENS,
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
    tok.add_tokens(added)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    wrapped.chat_template = template.replace("add_bos", "true" if add_bos else "false")
    return wrapped

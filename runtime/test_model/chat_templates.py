"""Chat templates of the test models, one per tool-call format a server can parse.

Each renders the tools, an assistant turn's tool calls and the tool results the way its
model family does, and writes a call exactly as the tool-call grammar of that format does
(``grammar.tool_calls``): ``{"name": <name as JSON>, "<arguments key>": <arguments>}`` with
the arguments string a client sends back inserted as is, so a re-sent conversation renders
to the text the model produced. ``add_bos`` is replaced by the builder ("true"/"false").

- chatml (hermes calls): ``<|im_start|>role\\n...<|im_end|>``, calls as
  ``<tool_call>{...}</tool_call>``, results as role ``tool``.
- llama3: ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``, tools as JSON in
  the system turn, calls as ``{"name": ..., "parameters": ...}`` joined by ``"; "``, results as
  role ``ipython``.
- qwen3: chatml with Qwen3's thinking (``<think>``/``</think>`` added tokens; the generation
  prompt stays open for the model's reasoning unless ``enable_thinking=False`` writes an empty
  block; reasoning kept only after the last user message).
- plain: chatml with no tool syntax at all (as SmolLM2-135M-Instruct's): it renders the same
  text with and without tools, so a server uses the generic format (``<tool_call>`` blocks
  described in its own system text, ``runtime.chat.generic_tools``) for it.
- mistral: ``[INST] ...[/INST]``, tools in ``[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]``, calls
  as ``[TOOL_CALLS][{...}, ...]`` ending the turn with EOS, results in
  ``[TOOL_RESULTS]...[/TOOL_RESULTS]``.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<|begin_of_text|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"

# An assistant message's calls, written with SEP between them and KEY for the arguments.
_CALLS = (
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if not loop.first %}{{- SEP }}{%- endif %}"
    "{{- '{\"name\": ' + (fn['name'] | tojson) + ', \"KEY\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}' }}"
    "{%- endfor %}"
)


def _calls(key: str, sep: str) -> str:
    return _CALLS.replace("SEP", repr(sep)).replace("KEY", key)


# Pieces the chatml and qwen3 templates share: the tools in a system turn, an assistant
# turn's calls as hermes blocks (CALLS: the Jinja expression of its calls), and the end of an
# assistant turn with the tool and plain turns after it.
_CHATML_TOOLS = (
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
)
_HERMES_CALLS = (
    "{%- for call in CALLS %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
)
_CHATML_OTHER_TURNS = (
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)


CHATML_TEMPLATE = (
    _CHATML_TOOLS + "{%- for message in msgs %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.get('content') %}{{- message['content'] }}{%- endif %}"
    + _HERMES_CALLS.replace("CALLS", "message['tool_calls']")
    + _CHATML_OTHER_TURNS
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PLAIN_TEMPLATE = (
    "{%- if add_bos %}{{ bos_token }}{% endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{%- if add_bos %}{{ bos_token }}{% endif %}"
    "{%- set msgs = messages %}"
    "{%- set system = '' %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set msgs = messages[1:] %}"
    "{%- endif %}"
    "{%- if system or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}"
    '{{- \'To call functions, answer with JSON objects {"name": function name, '
    '"parameters": arguments}, several separated by "; ". The functions:\\n\' }}'
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in msgs %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- if message.get('content') %}{{- message['content'] }}{%- endif %}"
    + _calls("parameters", "; ")
    + "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{{- (message['content'] or '') + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{%- if add_bos %}{{ bos_token }}{% endif %}"
    "{%- set msgs = messages %}"
    "{%- set system = '' %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\\n\\n' %}{%- set msgs = messages[1:] %}"
    "{%- endif %}"
    "{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{%- for message in msgs %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + (message['content'] or '') + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- if message.get('content') %}{{- message['content'] }}{%- endif %}"
    "{{- '[TOOL_CALLS][' }}" + _calls("arguments", ", ") + "{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- (message['content'] or '') + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS]' + (message['content'] or '') + '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)


# ChatML plus Qwen3's thinking: the generation prompt stays open for the model's own
# <think>...</think> unless ``enable_thinking=False``, which writes an empty block so the
# output is all answer; an assistant turn's reasoning (``reasoning_content``, or a
# <think> block in its content) is kept only after the last user message, as Qwen3 does
# for tool loops, and stripped from earlier turns.
QWEN3_TEMPLATE = (
    _CHATML_TOOLS + "{%- set ns = namespace(last_query=-1) %}"
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
    + _HERMES_CALLS.replace("CALLS", "message.get('tool_calls') or []")
    + _CHATML_OTHER_TURNS
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A template with the tokens it needs. special_tokens (after BOS, EOS, PAD) are skipped
    when decoding; added_tokens are single tokens that survive decoding (tool-call markup).
    turn_end: the token that ends an assistant turn, a stop token of the model."""

    name: str
    template: str
    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]
    turn_end: str


CHAT_TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(
        "chatml",
        CHATML_TEMPLATE,
        ("<|im_start|>", "<|im_end|>"),
        ("<tool_call>", "</tool_call>"),
        "<|im_end|>",
    ),
    # The generic format's <tool_call> markup stays one token each, as in chatml.
    "plain": ChatTemplate(
        "plain",
        PLAIN_TEMPLATE,
        ("<|im_start|>", "<|im_end|>"),
        ("<tool_call>", "</tool_call>"),
        "<|im_end|>",
    ),
    "llama3": ChatTemplate(
        "llama3",
        LLAMA3_TEMPLATE,
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        (),
        "<|eot_id|>",
    ),
    "mistral": ChatTemplate(
        "mistral",
        MISTRAL_TEMPLATE,
        ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")
        + ("[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        ("[TOOL_CALLS]",),
        EOS,
    ),
    # <think>/</think> come after the tool tokens: the qwen3 tokenizer's other ids are chatml's.
    "qwen3": ChatTemplate(
        "qwen3",
        QWEN3_TEMPLATE,
        ("<|im_start|>", "<|im_end|>"),
        ("<tool_call>", "</tool_call>", "<think>", "</think>"),
        "<|im_end|>",
    ),
}


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return CHAT_TEMPLATES[name]
    except KeyError:
        known = ", ".join(CHAT_TEMPLATES)
        raise ValueError(f"unknown chat template {name!r}; choose one of {known}") from None

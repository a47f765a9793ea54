"""The prompt of one Responses API turn, and what a stored turn keeps so the next can continue
from its KV.

The conversation is rendered with the chat template. Rendered from scratch, a previous answer
comes back as the template writes it, which need not be the tokens the model produced
(whitespace in a call's JSON, a token split differently), so the prompt would leave the radix
cache's path inside that answer. With ``previous_response_id`` the prompt is instead the
previous turn's prompt ids, its output ids, then the new text — when the rendering agrees: the
conversation is rendered once more with the previous answer replaced by a marker, and the text
before the marker must be the previous prompt's text exactly. The stop token the model ended
its answer with stays when the template ends the turn with that token (it is the text right
after the marker), and is left out otherwise.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from runtime.chat.generic_tools import ReplyEnvelope, call_names
from runtime.server.errors import ApiError
from runtime.server.openai_api import render_chat
from runtime.server.responses_store import StoredResponse
from runtime.server.state import ServerState
from runtime.tokenizer_manager import RequestOutput

# Stands for the previous turn's answer when the conversation is rendered around it.
_TURN = "\u2063arbor-previous-answer\u2063"


@dataclass(frozen=True)
class TurnPrompt:
    text: str  # the prompt as the chat template renders it
    ids: list[int]  # the tokens the model is given
    prefill_len: int = 0  # the Responses API continues no assistant message


async def conversation_prompt(
    state: ServerState,
    instructions: str | None,
    history: list[dict[str, Any]],
    functions: list[dict[str, Any]] | None,
    previous: StoredResponse | None,
    variables: dict[str, Any],
    envelope: ReplyEnvelope | None = None,
) -> TurnPrompt:
    """The prompt of ``instructions`` (a system message) + ``history`` with ``functions`` as
    tools and ``variables`` as extra template variables; ApiError 400 (param ``input``) when
    the template fails or the conversation is empty. Re-sent tool-calling turns keep their
    generated ids (``GeneratedTurns``). ``envelope``: the generic format's reply envelope
    (tool_choice auto), which the prompt describes."""
    offset = 1 if instructions else 0
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    if not messages:
        raise ApiError(400, "input: the conversation is empty", param="input")
    tools = [{"type": "function", "function": f} for f in functions] if functions else None
    tokenizer = state.tokenizer
    manager = state.tokenizer_manager
    text = await render_chat(state, messages, tools, variables, "input", envelope=envelope)
    after = None
    if previous is not None and previous.answer_index is not None:
        at = offset + previous.answer_index
        probe = [*messages[:at], {"role": "assistant", "content": _TURN}, *messages[at + 1 :]]
        # The marker stands for the answer's calls too: results still name their tools.
        known = call_names(messages[at : at + 1])
        before, found, rest = (
            await render_chat(state, probe, tools, variables, "input", known, envelope)
        ).partition(_TURN)
        if found and before == previous.prompt_text:
            after = rest
    if previous is None or after is None:
        ids = await manager.run_tokenizer(
            lambda: state.generated_turns.prompt_ids(text, messages), "input"
        )
        return TurnPrompt(text, ids)
    output = previous.output_ids.tolist()
    if previous.ends_with_stop_token:
        stop_text = tokenizer.decode(output[-1:], skip_special_tokens=False)
        if after.startswith(stop_text):
            after = after[len(stop_text) :]
        else:
            output = output[:-1]
    tail = await manager.run_tokenizer(
        lambda: tokenizer(after, add_special_tokens=False).input_ids, "input"
    )
    return TurnPrompt(text, previous.prompt_ids.tolist() + output + tail)


def stored_turn(
    response: dict[str, Any],
    items: list[dict[str, Any]],
    history: list[dict[str, Any]],
    answer: list[dict[str, Any]],
    prompt: TurnPrompt,
    final: RequestOutput,
) -> StoredResponse:
    """What the store keeps of a finished turn: ``history`` (the conversation it answered,
    without instructions), its ``answer`` as chat messages, and its tokens."""
    return StoredResponse(
        response=response,
        input_items=items,
        messages=history + answer,
        prompt_text=prompt.text,
        prompt_ids=array("i", prompt.ids),
        output_ids=array("i", final.output_ids),
        ends_with_stop_token=final.ends_with_stop_token,
        answer_index=len(history) if len(answer) == 1 else None,
    )

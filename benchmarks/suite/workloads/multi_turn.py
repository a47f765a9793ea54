"""multi-turn: chat sessions of several turns, each turn resending the whole history."""

from __future__ import annotations

import random
from collections.abc import Awaitable
from dataclasses import dataclass

from tqdm import tqdm

import frontend_lang as fl
from benchmarks.suite.systems.arbor import Traced, measure, stream_call
from benchmarks.suite.trace import Call, Clock, SystemRun
from benchmarks.suite.workloads.base import Workload
from benchmarks.suite.workloads.text import encode, paragraph
from runtime import Engine


@dataclass(frozen=True)
class Turn:
    """One user message (token ids, ending with the assistant header) and the reply length."""

    user_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class MultiTurn(Workload):
    """``sessions`` concurrent chats of ``turns`` turns (inclusive range, drawn per session).
    Turn k's prompt is the system message, every earlier user message and reply, and the new
    user message, in the model's chat template, sent as token ids (the history exactly as the
    model produced it). Replies have drawn lengths, EOS ignored."""

    name = "multi-turn"
    summary = "chat sessions of 4-8 turns, each turn resending the history"
    count_field = "sessions"

    sessions: int = 32
    turns: tuple[int, int] = (4, 8)
    user_sentences: tuple[int, int] = (2, 6)
    output_len: tuple[int, int] = (16, 96)

    @classmethod
    def preset(cls, quick: bool) -> MultiTurn:
        return cls(sessions=6, turns=(4, 5), output_len=(8, 32)) if quick else cls()

    def conversations(self, template: fl.ChatTemplate, tokenizer: object) -> list[list[Turn]]:
        rng = random.Random(self.seed)
        chats = []
        for _ in range(self.sessions):
            turns = []
            for _ in range(rng.randint(*self.turns)):
                text = paragraph(rng, rng.randint(*self.user_sentences))
                piece = template.prefix["user"] + text + template.suffix["user"]
                ids = encode(tokenizer, piece + template.prefix["assistant"])
                turns.append(Turn(ids, rng.randint(*self.output_len)))
            chats.append(turns)
        return chats

    def run_arbor(self, engine: Engine) -> SystemRun:
        tokenizer = engine.tokenizer
        template = turn_format(tokenizer)
        system = (
            template.prefix["system"] + "You are a helpful assistant." + template.suffix["system"]
        )
        start = encode(tokenizer, template.begin + system, first=True)
        reply_end = encode(tokenizer, template.suffix["assistant"])
        chats = self.conversations(template, tokenizer)

        async def session(group: int, turns: list[Turn], clock: Clock, bar: tqdm) -> list[Traced]:
            history, traced = start, []
            for wave, turn in enumerate(turns):
                prompt = history + turn.user_ids
                params = {"max_new_tokens": turn.output_len, "temperature": 0.0, "ignore_eos": True}
                output, timing, cached = await stream_call(engine, clock, prompt, params)
                traced.append(Traced(Call(prompt, output, group, wave), timing, cached))
                history = prompt + output + reply_end
                bar.update(1)
            return traced

        def clients(clock: Clock, bar: tqdm) -> list[Awaitable[list[Traced]]]:
            return [session(g, turns, clock, bar) for g, turns in enumerate(chats)]

        return measure(engine, clients, sum(len(t) for t in chats))


# Gemma's turn format: what a base model without a chat template (gemma3-270m) is given here.
GEMMA_TURNS = fl.ChatTemplate(
    "",
    {"system": "<start_of_turn>user\n", "user": "<start_of_turn>user\n",
     "assistant": "<start_of_turn>model\n"},
    {role: "<end_of_turn>\n" for role in ("system", "user", "assistant")},
)  # fmt: skip


def turn_format(tokenizer: object) -> fl.ChatTemplate:
    """The tokenizer's chat template as role blocks; for a base model without one, Gemma's turn
    format (the calls are token ids either way, and every system replays the same ones)."""
    try:
        return fl.ChatTemplate.from_tokenizer(tokenizer)
    except fl.ChatTemplateError:
        return GEMMA_TURNS

"""few-shot: MMLU-style multiple-choice questions sharing one long k-shot prefix."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from benchmarks.suite.systems.arbor import Request
from benchmarks.suite.workloads.base import RequestListWorkload
from benchmarks.suite.workloads.text import encode, sentence

LETTERS = "ABCD"


@dataclass(frozen=True)
class FewShot(RequestListWorkload):
    """``questions`` requests, each the same ``shots`` worked examples followed by its own
    question and four choices; ``output_len`` tokens each (EOS ignored)."""

    name = "few-shot"
    summary = "MMLU-style questions behind one shared k-shot prefix"
    count_field = "questions"

    questions: int = 128
    shots: int = 5
    question_words: int = 40
    output_len: int = 16

    @classmethod
    def preset(cls, quick: bool) -> FewShot:
        return cls(questions=16) if quick else cls()

    def requests(self, tokenizer: Any) -> list[Request]:
        rng = random.Random(self.seed)
        header = "The following are multiple choice questions (with answers) about history.\n\n"
        examples = "".join(
            _question(rng, self.question_words) + f" {rng.choice(LETTERS)}\n\n"
            for _ in range(self.shots)
        )
        prefix = encode(tokenizer, header + examples, first=True)
        return [
            Request(
                prefix + encode(tokenizer, _question(rng, self.question_words)),
                self.output_len,
                group=i,
            )
            for i in range(self.questions)
        ]


def _question(rng: random.Random, words: int) -> str:
    choices = "".join(f"\n{letter}. {sentence(rng, 6)}" for letter in LETTERS)
    return f"{sentence(rng, words)}{choices}\nAnswer:"

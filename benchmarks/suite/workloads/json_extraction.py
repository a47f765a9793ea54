"""json: extraction of a record into a JSON schema, decoded under the schema's grammar."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from benchmarks.suite.systems.arbor import Request
from benchmarks.suite.workloads.base import RequestListWorkload
from benchmarks.suite.workloads.text import encode, paragraph, sentence

CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Perth")
JOBS = ("engineer", "farmer", "teacher", "pilot", "nurse", "baker", "judge", "miner")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": list(CITIES)},
        "occupation": {"type": "string", "enum": list(JOBS)},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "maxItems": 3,
        },
        "summary": {"type": "string", "maxLength": 48},
    },
    "required": ["name", "age", "city", "occupation", "skills", "summary"],
}


@dataclass(frozen=True)
class JsonExtraction(RequestListWorkload):
    """``records`` requests: a shared instruction with one worked example, then a record's
    text; the answer is constrained by ``SCHEMA`` (greedy, at most ``max_tokens`` tokens; the
    grammar decides where it ends)."""

    name = "json"
    summary = "record extraction constrained by a JSON schema"
    count_field = "records"
    note = "constrained by the JSON schema"

    records: int = 64
    record_sentences: int = 4
    max_tokens: int = 160

    @classmethod
    def preset(cls, quick: bool) -> JsonExtraction:
        return cls(records=12) if quick else cls()

    def requests(self, tokenizer: Any) -> list[Request]:
        rng = random.Random(self.seed)
        instruction = (
            "Extract the person described in the text as a JSON object with the fields name, "
            "age, city, occupation, skills and summary.\n\n"
            f"Text: {self._record(rng, 'Ada Stone', 36, 'Oslo', 'pilot')}\n"
            'JSON: {"name":"Ada Stone","age":36,"city":"Oslo","occupation":"pilot",'
            '"skills":["navigation"],"summary":"A pilot from Oslo."}\n\n'
        )
        prefix = encode(tokenizer, instruction, first=True)
        sampling = {"json_schema": SCHEMA, "ignore_eos": False}
        requests = []
        for i in range(self.records):
            name = f"{sentence(rng, 1)[:-1]} {sentence(rng, 1)[:-1]}"
            text = self._record(
                rng, name, rng.randint(18, 90), rng.choice(CITIES), rng.choice(JOBS)
            )
            prompt = prefix + encode(tokenizer, f"Text: {text}\nJSON: ")
            requests.append(Request(prompt, self.max_tokens, sampling, group=i))
        return requests

    def _record(self, rng: random.Random, name: str, age: int, city: str, job: str) -> str:
        facts = f"{name} is a {age}-year-old {job} who lives in {city}."
        return f"{facts} {paragraph(rng, self.record_sentences)}"

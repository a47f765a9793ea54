"""Retrieval-augmented answers: retrieve the best passages from a small local corpus by word
overlap, then answer with a JSON object that must match a schema (constrained decoding, so it
always parses). The system prompt is shared by every question, so it is prefilled once."""

from __future__ import annotations

import re

import frontend_lang as fl

CORPUS = [
    "The radix cache keeps the KV cache of every prefix the runtime has seen, keyed by token ids.",
    "Requests that share a system prompt or chat history reuse its cached KV instead of "
    "recomputing it.",
    "Least recently used leaves of the radix tree are evicted first when KV memory runs out.",
    "A grammar engine turns JSON schemas and regular expressions into per-step token masks.",
    "Continuous batching adds new requests to the running batch at every decoding step.",
    "Chunked prefill splits a long prompt so that running decodes are not starved.",
]
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 40},
        "source": {"type": "integer", "minimum": 0, "maximum": len(CORPUS) - 1},
    },
    "required": ["answer", "source"],
    "additionalProperties": False,
}


def retrieve(question: str, k: int = 2) -> list[int]:
    """The indices of the ``k`` passages sharing the most words with the question."""

    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z]+", text.lower()))

    asked = words(question)
    ranked = sorted(range(len(CORPUS)), key=lambda i: -len(asked & words(CORPUS[i])))
    return ranked[:k]


@fl.function
def rag(s: fl.ProgramState, question: str, max_tokens: int = 96):
    s += fl.system("Answer the question from the passages. Give the number of the source.")
    with s.user():
        for i in retrieve(question):
            s += f"[{i}] {CORPUS[i]}\n"
        s += f"Question: {question}"
    s += fl.assistant(fl.gen("answer", json_schema=ANSWER, max_tokens=max_tokens))


def main(backend: fl.Backend, max_tokens: int = 96) -> list[fl.ProgramState]:
    questions = ["What is evicted when memory runs out?", "How are JSON schemas enforced?"]
    states = rag.run_batch(
        [{"question": q, "max_tokens": max_tokens} for q in questions],
        backend=backend,
        progress_bar=False,
    )
    for question, state in zip(questions, states, strict=True):
        cached = state.get_meta_info("answer")["cached_tokens"]
        print(f"{question}\n  -> {state.parsed('answer')} (cached prompt tokens: {cached})")
    return states


if __name__ == "__main__":
    from _backend import open_backend, parse_args

    arguments = parse_args(__doc__, max_tokens=96)
    with open_backend(arguments) as chosen:
        main(chosen, arguments.max_tokens)

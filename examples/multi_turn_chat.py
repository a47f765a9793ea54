"""A multi-turn chat rendered with the model's chat template. Each turn extends the same
conversation text, so the runtime serves the whole history from its cache and prefills only
the new turn; the last turn is streamed as it is generated."""

from __future__ import annotations

import frontend_lang as fl

TURNS = [
    "Hi! Can you help me plan a weekend trip?",
    "I like hiking and quiet places.",
    "Which one would you pick?",
]


@fl.function
def chat(s: fl.ProgramState, turns: list[str], max_tokens: int = 32):
    s += fl.system("You are a friendly travel assistant.")
    for i, turn in enumerate(turns):
        s += fl.user(turn)
        s += fl.assistant(fl.gen(f"reply_{i}", max_tokens=max_tokens))


def main(backend: fl.Backend, max_tokens: int = 32) -> fl.ProgramState:
    state = chat.run(turns=TURNS[:-1], max_tokens=max_tokens, backend=backend)
    for i, turn in enumerate(TURNS[:-1]):
        cached = state.get_meta_info(f"reply_{i}")["cached_tokens"]
        print(f"user: {turn}\nassistant: {state[f'reply_{i}']!r}  (cached tokens: {cached})")
    streamed = chat.run(turns=TURNS, max_tokens=max_tokens, backend=backend, stream=True)
    print(f"user: {TURNS[-1]}\nassistant (streamed): ", end="")
    for piece in streamed.text_iter(f"reply_{len(TURNS) - 1}"):
        print(repr(piece), end=" ", flush=True)
    print()
    return streamed


if __name__ == "__main__":
    from _backend import open_backend, parse_args

    arguments = parse_args(__doc__)
    with open_backend(arguments) as chosen:
        main(chosen, arguments.max_tokens)

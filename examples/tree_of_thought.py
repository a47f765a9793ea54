"""Tree of thought: fork the reasoning into branches that propose approaches concurrently,
let each branch judge itself with `select`, and continue from the most promising one. The
branches share the prompt, which the runtime prefills once for all of them."""

from __future__ import annotations

import frontend_lang as fl


@fl.function
def tree_of_thought(s: fl.ProgramState, problem: str, width: int = 3, max_tokens: int = 32):
    s += fl.system("You solve problems by comparing several approaches.")
    s += fl.user(problem)
    with s.assistant():
        s += "Let me consider a few approaches.\n"
        forks = s.fork(width)
        for i, branch in enumerate(forks):
            branch += f"Approach {i + 1}: "
            branch += fl.gen("approach", max_tokens=max_tokens, stop="\n")
            branch += "\nIs this approach sound? " + fl.select("sound", choices=["yes", "no"])
        forks.join()
        # How much more likely "yes" was than "no", per branch.
        margins = [meta["scores"][0] - meta["scores"][1] for meta in s.get_meta_info("sound")]
        best = max(range(width), key=lambda i: margins[i])
        s += f"The best is approach {best + 1}: {s['approach'][best]}\nSo the answer is "
        s += fl.gen("answer", max_tokens=max_tokens, stop="\n")


def main(backend: fl.Backend, max_tokens: int = 32, width: int = 3) -> fl.ProgramState:
    state = tree_of_thought.run(
        problem="A train leaves at 9:40 and arrives at 11:15. How long is the trip?",
        width=width,
        max_tokens=max_tokens,
        backend=backend,
    )
    for i, (approach, verdict) in enumerate(zip(state["approach"], state["sound"], strict=True)):
        print(f"approach {i + 1} ({verdict}): {approach!r}")
    print("answer:", repr(state["answer"]))
    return state


if __name__ == "__main__":
    from _backend import open_backend, parse_args

    arguments = parse_args(__doc__)
    with open_backend(arguments) as chosen:
        main(chosen, arguments.max_tokens)

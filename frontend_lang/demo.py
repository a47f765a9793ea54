"""The DSL part of ``arbor demo``: a program (select + fork) run over HTTP on the server the
demo started. The demo runs it as ``python -m frontend_lang.demo URL``: the runtime does not
import the DSL, which is a client of it."""

from __future__ import annotations

import sys
from typing import Any

import frontend_lang as fl


def travel_program() -> Any:
    """The demo's DSL program (``city`` in, ``continent`` and two ``fact`` out): a constrained
    choice, then two branches forked from it that share its prefix in the radix cache."""

    @fl.function
    def travel(s: Any, city: str) -> None:
        s += fl.user(f"Is {city} in Europe or in Asia? Answer with one word.")
        with s.assistant():
            s += fl.select("continent", choices=["Europe", "Asia"])
        forks = s.fork(2)
        for branch, topic in zip(forks, ("a famous food", "a famous building"), strict=True):
            branch += fl.user(f"Name {topic} of {city}, in one short sentence.")
            with branch.assistant():
                branch += fl.gen("fact", max_tokens=40, stop="\n", temperature=0)
        forks.join()

    return travel


def main(url: str) -> None:
    print("\n3. DSL program (select + fork), city = Rome")
    backend = fl.RuntimeEndpoint(url)
    try:
        state = travel_program().run(city="Rome", backend=backend)
    finally:
        backend.shutdown()
    print(f"   continent (select): {state['continent']}")
    for topic, fact in zip(("food", "building"), state["fact"], strict=True):
        print(f"   {topic} (fork branch): {fact.strip()}")


if __name__ == "__main__":
    main(sys.argv[1])

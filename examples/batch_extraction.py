"""Batch extraction: pull typed fields out of many records with `run_batch` (a progress bar
shows the runs finishing). The instructions are a prefix shared by every record, so the
runtime prefills them once; the runs' calls are batched together."""

from __future__ import annotations

import frontend_lang as fl

INSTRUCTIONS = (
    "Extract the name, the age and the kind of each record.\n"
    "Record: Acme Corp was founded 41 years ago.\nName: Acme Corp\nAge: 41\nKind: company\n\n"
)
RECORDS = [
    "Alice Smith is 34 and works as an engineer in Paris.",
    "The Louvre, 230 years old, is a museum in Paris.",
    "Bob Jones, aged 57, is a retired teacher.",
    "Globex, a 12-year-old startup, sells batteries.",
    "Mount Fuji last erupted 317 years ago.",
]


@fl.function
def extract(s: fl.ProgramState, record: str, max_tokens: int = 16):
    s += INSTRUCTIONS + f"Record: {record}\n"
    s += "Name: " + fl.gen("name", max_tokens=max_tokens, stop="\n")
    s += "\nAge: " + fl.gen("age", dtype=int, max_tokens=8)
    s += "\nKind: " + fl.select("kind", choices=["person", "company", "place"])


def main(backend: fl.Backend, max_tokens: int = 16) -> list[dict[str, object]]:
    states = extract.run_batch(
        [{"record": record, "max_tokens": max_tokens} for record in RECORDS],
        backend=backend,
        progress_bar=True,
    )
    rows = [{"name": s["name"], "age": s["age"], "kind": s["kind"]} for s in states]
    for record, row in zip(RECORDS, rows, strict=True):
        print(f"{record}\n  -> {row}")
    return rows


if __name__ == "__main__":
    from _backend import open_backend, parse_args

    arguments = parse_args(__doc__, max_tokens=16)
    with open_backend(arguments) as chosen:
        main(chosen, arguments.max_tokens)

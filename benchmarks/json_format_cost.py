"""The grammar's own work per decode step, compact against aligned JSON.

16 matchers of ``long_fixed_keys`` over the ``small`` test model's 151,936-token vocabulary
fill their masks and accept one token each per step, walking the schema's document (compact,
or pretty-printed with an indent of 2) token by token; mean and median ms per step, per round::

    python -m benchmarks.json_format_cost [--rounds 3]

``overlap_bench`` measures the whole step; this isolates what the layout changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.grammar_bench import LONG_KEYS, VOCAB
from grammar import GrammarOptions, GrammarSpec, allocate_bitmask, create_backend
from runtime.model_config import ModelConfig
from runtime.model_files import load_tokenizer
from runtime.test_model import cached_test_model

BATCH = 16


def _document() -> dict[str, Any]:
    values = {"integer": 42, "boolean": True, "string": "x"}
    props = LONG_KEYS["properties"]
    return {k: s["enum"][0] if "enum" in s else values[s["type"]] for k, s in props.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = cached_test_model("small", "llama", vocab_size=VOCAB)
    tokenizer = load_tokenizer(path)
    config = ModelConfig.from_pretrained(path)
    backend = create_backend("xgrammar", tokenizer, config.vocab_size, config.eos_token_ids)
    doc = _document()
    texts = {
        "compact": json.dumps(doc, separators=(",", ":")),
        "aligned": json.dumps(doc, indent=2),
    }
    mask = allocate_bitmask(BATCH, config.vocab_size)
    rows = list(range(BATCH))
    for _ in range(args.rounds):
        for fmt, text in texts.items():
            spec = GrammarSpec.for_json_schema(LONG_KEYS, GrammarOptions(json_format=fmt))
            compiled = backend.compile(spec)
            matchers = [compiled.new_matcher() for _ in rows]
            steps = []
            for token in tokenizer.encode(text, add_special_tokens=False):
                start = time.perf_counter()
                backend.fill_masks(matchers, mask, rows)
                accepted = backend.accept_tokens(matchers, [token] * BATCH)
                steps.append((time.perf_counter() - start) * 1e3)
                assert all(accepted), (fmt, token)
            print(
                f"{fmt}: {len(steps)} tokens, mean {statistics.mean(steps):.3f} ms/step, "
                f"median {statistics.median(steps):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

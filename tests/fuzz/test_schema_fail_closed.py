"""Fail closed: a JSON schema is either refused by name, or every finished output validates.

Hypothesis writes schemas from a grammar of keywords (bounds, ``const``/``enum``, objects,
arrays, ``anyOf``/``oneOf``/``allOf``, typeless keywords) whose ``$ref``s come in every shape
the resolver must get right: ``#`` (recursion through the root), definitions in ``$defs`` or
``definitions`` whose names need ``~0``/``~1`` escapes or percent-encoding, pointers two
segments deep, references with siblings, cycles through definitions, and references spelled
relative to the document's ``$id`` (drafts 4, 6, 7, 2019-09 and 2020-12). Each schema is
compiled in process; either it is refused with a ``GrammarError`` that does not come from the
backend, or it is sampled at temperature 1 on the tiny model and every finished output must
satisfy ``jsonschema``'s validator for the schema's own draft.

``make test`` runs a bounded, derandomized slice (60 schemas); ``make fuzz`` runs fresh
rounds for SCHEMA_REFS_SHARE of ARBOR_FUZZ_SECONDS (tests/fuzz/budget.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grammar import GrammarError, GrammarService, GrammarSpec, create_backend
from grammar.schema_walk import escape_pointer
from runtime.model_config import ModelConfig
from runtime.model_runner import ModelRunner, RunnerConfig
from tests.fuzz.budget import LONG_RUN, fuzz_settings, run_rounds
from tests.grammar.decoder import ConstrainedDecoder

pytestmark = pytest.mark.timeout(0 if LONG_RUN else 300)

# The share of ARBOR_FUZZ_SECONDS this test gets in the long run.
SCHEMA_REFS_SHARE = 0.1
SEEDS = (0, 1, 2)
MAX_TOKENS = 64
BIAS = 4.0  # see tests/grammar/decoder.py: helps a random model finish; the mask decides

DRAFTS = [
    None,
    "https://json-schema.org/draft/2020-12/schema",
    "https://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft-07/schema#",
    "http://json-schema.org/draft-06/schema#",
    "http://json-schema.org/draft-04/schema#",
]
BASE = "https://example.com/schemas/root.json"
NAMES = ["a", "r/s", "t~u", "p q", "50%", "ü", "item"]
SCALARS = st.one_of(
    st.integers(-3, 12), st.sampled_from(["x", "yz", "r/s", ""]), st.booleans(), st.none()
)


def _leaves(refs: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    bounds = st.fixed_dictionaries(
        {}, optional={"minimum": st.integers(-5, 5), "maximum": st.integers(0, 20)}
    )
    return st.one_of(
        bounds.map(lambda b: {"type": "integer", **b}),
        bounds,  # typeless: numbers are bounded, other values free
        st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": ["null", "boolean"]}]),
        st.lists(SCALARS, min_size=1, max_size=4).map(lambda values: {"enum": values}),
        SCALARS.map(lambda value: {"const": value}),
        st.sampled_from(refs).map(lambda ref: {"$ref": ref}),
    )


def _nodes(
    refs: list[str], children: st.SearchStrategy[dict[str, Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    objects = _objects(children)
    arrays = st.builds(
        lambda items, most: {"type": "array", "items": items, "maxItems": most},
        children,
        st.integers(0, 3),
    )
    combined = st.builds(
        lambda sibling, key, branches: {**sibling, key: branches},
        st.sampled_from([{}, {"type": "object"}, {"type": "integer"}, {"minimum": 0}]),
        st.sampled_from(["anyOf", "oneOf", "allOf"]),
        st.lists(children, min_size=1, max_size=3),
    )
    ref_with_siblings = st.builds(
        lambda ref, sibling: {"$ref": ref, **sibling},
        st.sampled_from(refs),
        st.sampled_from([{"type": "object"}, {"maximum": 3}, {"required": ["k"]}, {"enum": [1]}]),
    )
    return st.one_of(objects, arrays, combined, ref_with_siblings)


@st.composite
def _objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    names = st.sampled_from(["k", "m", "n"])
    properties = draw(st.dictionaries(names, children, min_size=1, max_size=3))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True, max_size=2))
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


def _spellings(pointer: str, base: str | None) -> list[str]:
    """Ways to write a reference to ``pointer`` that all mean the same target."""
    spelled = [f"#{pointer}", f"#{quote(pointer, safe='/~')}"]
    if base is not None:
        spelled += [f"root.json#{pointer}", f"{base}#{quote(pointer, safe='/~')}"]
    return spelled


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """A schema document: a draft, perhaps an ``$id``, definitions (some behind a non-schema
    key, so only a two-segment pointer reaches them) and references to any of them."""
    draft = draw(st.sampled_from(DRAFTS))
    id_keyword = "id" if draft is not None and "draft-04" in draft else "$id"
    base = draw(st.sampled_from([None, BASE]))
    container = draw(st.sampled_from(["$defs", "definitions"]))
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    deep = {name: draw(st.booleans()) for name in names}
    pointers = [""] + [
        f"/{container}/{escape_pointer(name)}" + ("/full" if deep[name] else "") for name in names
    ]
    refs = [ref for pointer in pointers for ref in _spellings(pointer, base)]
    leaves = _leaves(refs)
    schemas = st.recursive(leaves, lambda inner: _nodes(refs, inner), max_leaves=5)
    definitions = {}
    for name in names:
        body = draw(schemas)
        definitions[name] = {"full": body} if deep[name] else body
    document: dict[str, Any] = dict(draw(schemas))
    document[container] = definitions
    if base is not None:
        document[id_keyword] = base
    if draft is not None:
        document["$schema"] = draft
    return document


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@pytest.fixture(scope="module")
def compiler(tiny_model_path: Path) -> Iterator[tuple[ConstrainedDecoder, GrammarService]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = ModelConfig.from_pretrained(tiny_model_path)
    backend = create_backend("xgrammar", tokenizer, config.vocab_size, config.eos_token_ids)
    runner = ModelRunner(
        RunnerConfig(str(tiny_model_path), kv_slots=2048, max_requests=4, context_len=512)
    )
    service = GrammarService(backend, cache_size=64, compile_timeout=60.0)
    try:
        yield ConstrainedDecoder(runner, tokenizer, backend), service
    finally:
        service.shutdown()


def test_schemas_are_refused_by_name_or_every_output_validates(
    compiler: tuple[ConstrainedDecoder, GrammarService],
) -> None:
    decoder, service = compiler

    @fuzz_settings(slice_examples=60)
    @given(schema=documents())
    def case(schema: dict[str, Any]) -> None:
        try:  # what the request path prepares (grammar.sandbox.prepare)
            compiled = service.compile(GrammarSpec.for_json_schema(schema))
        except GrammarError as exc:
            # The checks refuse in our words; "see the server log" marks a backend refusal.
            assert "server log" not in str(exc), f"{exc} for {json.dumps(schema)}"
            return
        if not compiled.admits_output(decoder.vocab_size):
            return  # refused there as admitting no output
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        outputs = decoder.generate([compiled] * len(SEEDS), SEEDS, MAX_TOKENS, 1.0, BIAS)
        for seed, output in zip(SEEDS, outputs, strict=True):
            if not output.terminated:
                continue
            value = json.loads(output.text, parse_constant=_reject_constant)
            error = jsonschema.exceptions.best_match(validator.iter_errors(value))
            assert error is None, (
                f"seed {seed}: {output.text!r} breaks {json.dumps(schema)}: {error.message}"
            )

    run_rounds(case, SCHEMA_REFS_SHARE)

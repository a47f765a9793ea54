"""benchmarks/schema_bench: the corpus it assembles and how it buckets outcomes."""

from __future__ import annotations

from benchmarks import schema_bench


def test_the_corpus_has_the_metaschemas_and_their_definitions() -> None:
    samples = schema_bench.corpus(400)
    names = [name for name, _ in samples]
    assert len(names) == len(set(names))
    assert any(name.startswith("metaschema-") for name in names)
    assert any("#" in name for name in names)  # a definition as a sample of its own


def test_a_definition_sample_references_its_definition() -> None:
    old = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "properties": {"a": {"$ref": "#/definitions/x"}},
        "definitions": {"x": {"type": "integer"}, "y/z": {"$ref": "#/properties/a"}},
    }
    parts = dict(schema_bench._samples("s", old))
    assert parts["s"] is old
    # Draft 7 ignores the siblings of $ref, so the whole root stays for references into it.
    assert parts["s#y/z"]["$ref"] == "#/definitions/y~1z"
    assert parts["s#y/z"]["properties"] == old["properties"]
    new = {**old, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert set(dict(schema_bench._samples("n", new))["n#x"]) == {"$schema", "definitions", "$ref"}


def test_refusals_are_counted_by_keyword() -> None:
    message = "unsupported JSON schema feature 'uniqueItems' at /items: item uniqueness ..."
    match = schema_bench._REFUSED.match(message)
    assert match is not None and match.group(1) == "uniqueItems"
    assert schema_bench._bucket("invalid JSON schema at /a/b: 3 is not of type 'string'") == (
        "invalid JSON schema at /a/b"
    )

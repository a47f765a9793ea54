"""Constrained decoding: JSON schema, regex, EBNF, choices and tool calls as per-step token masks.

Typical use by a scheduler::

    backend = create_backend("xgrammar", tokenizer, vocab_size, stop_token_ids)
    service = GrammarService(backend, compile_timeout=30.0)
    spec = GrammarSpec.from_sampling_params(params)   # None, or GrammarError at the API edge
    handle = service.submit(spec)                     # then each loop: service.poll(handle)
    matcher = compiled.new_matcher()
    apply_grammar_masks(backend, logits, [matcher or None per row])   # each step
    matcher.accept_token(token)                                       # after sampling

See docs/grammar.md for the integration protocol and what the backend enforces.

The names below load on first use (most modules import xgrammar and torch), so a process that
only needs the tool-call formats (``grammar.tool_call_formats``: the server's HTTP process)
does not pay for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from grammar.backend import (
        CompiledGrammar,
        GrammarBackend,
        GrammarMatcher,
        LoweredGrammar,
        allocate_bitmask,
        allow_token,
        create_backend,
        register_backend,
    )
    from grammar.errors import GrammarCompileTimeout, GrammarError, UnsupportedSchemaFeature
    from grammar.jump_forward import (
        DraftVerdict,
        commit_draft,
        fill_draft_masks,
        sample_inverse_cdf,
        verify_draft,
    )
    from grammar.masking import apply_filled_masks, apply_grammar_masks
    from grammar.options import GrammarOptions
    from grammar.regex import to_backend_regex
    from grammar.sandbox import CompileSandbox, Prepared
    from grammar.schema_check import check_schema
    from grammar.schema_formats import SUPPORTED_FORMATS
    from grammar.service import CacheStats, CompileHandle, GrammarService
    from grammar.spec import KINDS, GrammarSpec
    from grammar.stop_regex import StopRegex
    from grammar.validate import output_validator

__all__, __getattr__ = lazy_exports(__name__)

"""Constrained decoding: JSON schema, regex and EBNF grammars compiled into per-step token masks."""

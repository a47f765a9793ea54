"""The Arbor DSL for multi-call LLM programs: gen, select, fork/join, roles and backends."""

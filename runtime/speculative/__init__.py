"""Speculative decoding: what proposes draft tokens for the target model to verify.

``ngram``: prompt lookup in the request's own tokens (no second model). ``draft_worker``: a
small draft model with its own KV pool and radix cache (``DraftModelWorker``, ``DraftJob``,
``ChooseFn``). The scheduler's DraftManager verifies every draft, whatever proposed it, in
the forward that also runs the request's next token. Nothing is imported here, so the
lookup does not load the model code.
"""

"""Drafts and speculative decoding: tokens proposed after a step and verified by the next.

``drafts``: the ``DraftManager`` the scheduler calls (propose, mask, verify) and each request's
``DraftState``. ``proposers``: the ``Proposer`` interface and its n-gram and draft-model
implementations (``ngram``: prompt lookup; ``draft_worker``: the draft model, its KV pool and
radix cache). ``verify``: the speculative rule over the request's own sampling pipeline.
``policy``: how far to draft. Nothing is imported here, so the lookup does not load the model
code.
"""

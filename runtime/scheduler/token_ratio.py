"""How much KV to reserve for running decodes: an estimated ratio of max_new_tokens they will use.

Starts optimistic and decays each step (most requests stop well before max_new_tokens); a
retraction proves the estimate was too low, so it jumps back to fully conservative.
"""

from __future__ import annotations

from runtime.scheduler.req import Req

# Reserve for at most this many future tokens per request: a request asking for 100k new
# tokens should not block admission of everything else.
CLIP_NEW_TOKENS = 4096


class NewTokenRatio:
    def __init__(self, conservativeness: float = 1.0) -> None:
        self.initial = min(1.0, 0.7 * conservativeness)
        self.minimum = min(1.0, 0.1 * conservativeness)
        self.decay = (self.initial - self.minimum) / 600
        self.value = self.initial

    def reserve(self, req: Req) -> int:
        """KV tokens to hold back for ``req``'s future decode steps."""
        return int(min(req.remaining_new_tokens, CLIP_NEW_TOKENS) * self.value)

    def step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def on_retract(self) -> None:
        self.value = 1.0

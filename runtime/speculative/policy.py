"""How many tokens speculation should draft: worth it only where it pays on this device.

A draft token costs a row of the verify forward (and, with a draft model, a draft step); it
pays when the target accepts it, saving part of a later step. On a GPU decode is bound by
reading the weights, so extra rows are nearly free; on a CPU they are not (measured, small
model, 16 requests at 160 tokens of context: a 16-token decode forward 5.4 ms, with one extra
row per request 8.2 ms, so an extra row costs half a request's share of the step). Drafting
blind would then make a workload with useless drafts much slower.

So the length follows a simple model. Each request has a per-token acceptance estimate ``a``
(accepted tokens over tried ones, decayed, with a prior: the rate over all requests so far,
3 in 5 for the first ones); a draft's i-th token is accepted with probability about a^i and
then saves a request's share of a step. A draft of k tokens costs k times ``c`` (a token's
rows, relative to that share) plus a fixed ``f`` (the host work of proposing and verifying
it instead of sampling one token), so the length drafted is the k that maximises
a + a^2 + ... + a^k - k c - f, none when that is not positive.
``VerifyCost`` measures c from the scheduler's own decode forwards (a decayed least-squares
fit of forward time against token rows; prefill chunks are left out, a large chunk's rows
costing less each than a small batch's); f from the time verifications take and, with a draft
model, from the draft's time per request drafted for (its catch-up included: a call runs a
catch-up forward and one per draft position whatever the tokens, so its time is counted per
request, not per token). Where no k pays, the
request probes with one token now and then (exponentially rarer while probes fail), so a
request whose text turns repetitive later is noticed; but only while drafting pays for the
server's requests as a whole (an acceptance estimate over all of them), since a probe is not
free either: a draft model must first catch up with every token since the request's last
draft (on the small CPU model at 16 requests, probing alone cost 9% of the throughput).
"""

from __future__ import annotations

from dataclasses import dataclass

# Before any measurement: a verify row's cost relative to a request's share of a decode step
# (CPU: measured about 0.5 at 16 requests, less at 1; GPU: rows are nearly free).
PRIOR_COST = {"cpu": 0.3, "cuda": 0.05}
FIRST_PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 128


class VerifyCost:
    """What drafting costs relative to a request's share of a decode step, measured.

    ``observe_forward(seconds, tokens)``: one decode forward's time and its token rows
    (fitted as time = fixed + per_token * tokens, decayed). ``observe_draft(seconds,
    requests)``: a draft model's call drafting for ``requests``. ``observe_verify(seconds)``: one
    verification's host time. ``relative(batch)``: (per draft token, per draft) at a decode
    batch of ``batch`` requests, in units of one request's share of a step.
    """

    def __init__(self, prior: float, decay: float = 0.97) -> None:
        self.prior = prior
        self.decay = decay
        # Decayed sums for the least-squares fit of forward seconds against token rows.
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._draft_seconds = self._drafted = 0.0
        self._verify_seconds = self._verifies = 0.0

    def observe_forward(self, seconds: float, tokens: int) -> None:
        d = self.decay
        self._n = d * self._n + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def observe_draft(self, seconds: float, requests: int) -> None:
        self._draft_seconds = self.decay * self._draft_seconds + seconds
        self._drafted = self.decay * self._drafted + requests

    def observe_verify(self, seconds: float) -> None:
        self._verify_seconds = self.decay * self._verify_seconds + seconds
        self._verifies = self.decay * self._verifies + 1.0

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token row), or None until the rows varied enough."""
        if self._n < 4:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        if var < 0.25:  # every forward had about the same rows: no slope to read
            return None
        slope = (self._xy / self._n - mean_x * mean_y) / var
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def relative(self, batch: int) -> tuple[float, float]:
        batch = max(batch, 1)
        fitted = self.fit()
        if fitted is None:
            return self.prior, 0.0
        fixed, per_token = fitted
        share = (fixed + per_token * batch) / batch  # a plain decode step's time per request
        if share <= 0.0:
            return self.prior, 0.0
        draft = self._draft_seconds / self._drafted if self._drafted >= 1 else 0.0
        verify = self._verify_seconds / self._verifies if self._verifies >= 1 else 0.0
        return per_token / share, (verify + draft) / share


@dataclass
class Acceptance:
    """One request's per-token acceptance estimate and its probing state."""

    hits: float = 0.0
    tries: float = 0.0
    probe_interval: int = FIRST_PROBE_INTERVAL
    wait: int = 0  # steps until the next probe while no length pays
    # The prior: as if 3 of 5 tried tokens had been accepted.
    prior_hits: float = 3.0
    prior_tries: float = 5.0
    decay: float = 0.9

    @property
    def rate(self) -> float:
        return (self.hits + self.prior_hits) / (self.tries + self.prior_tries)

    def start_from(self, overall: Acceptance) -> None:
        """Take ``overall``'s rate as this estimate's prior (a new request is expected to
        accept what the server's requests accept), with the same weight as the default."""
        self.prior_hits = overall.rate * self.prior_tries

    def record(self, proposed: int, accepted: int) -> None:
        """One verification: the first ``accepted`` tokens held, the next (if any) failed."""
        failed = 1 if accepted < proposed else 0
        self.hits = self.decay * self.hits + accepted
        self.tries = self.decay * self.tries + accepted + failed

    def worth(self, cost: tuple[float, float], ceiling: int) -> int:
        """The k <= ceiling with the best expected gain given ``cost`` = (per token, per
        draft); 0 when none gains."""
        per_token, per_draft = cost
        rate = self.rate
        k, best, gain, p = 0, 0.0, -per_draft, 1.0
        for i in range(1, ceiling + 1):
            p *= rate
            gain += p - per_token
            if gain > best:
                k, best = i, gain
        return k

    def length(self, cost: tuple[float, float], ceiling: int, probe: bool = True) -> int:
        """Tokens to draft now: ``worth``; when that is 0 and ``probe``, 1 token every
        ``probe_interval`` steps (doubling while probes fail)."""
        k = self.worth(cost, ceiling)
        if k:
            self.probe_interval, self.wait = FIRST_PROBE_INTERVAL, 0
            return k
        if not probe:
            return 0
        if self.wait > 0:
            self.wait -= 1
            return 0
        self.wait = self.probe_interval
        self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        return min(1, ceiling)

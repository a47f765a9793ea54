"""How long the fuzz tests run.

Plain ``pytest`` (``make test``) runs a bounded, reproducible slice: few examples, derandomized,
no example database. ``make fuzz`` sets ``ARBOR_FUZZ_SECONDS`` (600): each test then runs with
fresh random seeds, round after round, until its share of that time is spent.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, settings

FUZZ_SECONDS = float(os.environ.get("ARBOR_FUZZ_SECONDS") or 0)
LONG_RUN = FUZZ_SECONDS > 0
# Examples per round in the long run: small, so the last round overruns a test's share little.
LONG_RUN_EXAMPLES = 50
# The share of schemathesis's explicit (coverage) cases the bounded slice sends, picked by a
# hash of each request: the same cases every run. The long run sends them all. (All of them,
# 4,900 requests, were a fifth of `make test`'s time on two cores.)
SLICE_CASE_SHARE = 0.4


def in_slice(request: str) -> bool:
    """Whether the bounded slice sends the explicit case ``request`` (always, in the long
    run): a stable choice of SLICE_CASE_SHARE of them."""
    return LONG_RUN or zlib.crc32(request.encode()) % 1000 < SLICE_CASE_SHARE * 1000


def fuzz_settings(slice_examples: int) -> settings:
    """Hypothesis settings: ``slice_examples`` derandomized examples in the bounded slice,
    LONG_RUN_EXAMPLES random ones per round in the long run. Requests take a variable time,
    so no deadline; generated bodies are big by design, so no size health checks; no
    explain phase (it replays a failure many times, each a request)."""
    common = settings(
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        print_blob=True,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    )
    if LONG_RUN:
        return settings(common, max_examples=LONG_RUN_EXAMPLES, derandomize=False)
    return settings(common, max_examples=slice_examples, derandomize=True)


def run_rounds(test: Callable[[], None], share: float) -> None:
    """Run a Hypothesis test once in the bounded slice; in the long run, again and again (new
    random examples each round) until ``share`` of ARBOR_FUZZ_SECONDS is spent."""
    deadline = time.monotonic() + FUZZ_SECONDS * share
    test()
    while LONG_RUN and time.monotonic() < deadline:
        test()

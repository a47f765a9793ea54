"""``GET /health``: the liveness probe, and with ``?deep=1`` the readiness probe.

The plain probe costs nothing (no message to any process): 200 ``{"status": "ok"}`` once the
scheduler is ready and its loop still turns, else 503 with the reason in ``status`` (and the
detail in ``error``): ``starting`` (the model loads), ``warming up`` (the server's warm-up
runs its first requests and the tool calibration: ``runtime/server/warm_up.py``), ``dead``
(the scheduler crashed), ``no replica serving`` (a routed server's replicas are all down),
``stalled`` (the scheduler has not finished a loop iteration within the stall bound;
``runtime/heartbeat.py``).

The deep probe also sends a one-token request through the whole pipeline (tokenizer,
scheduler, detokenizer, back) and answers 503 ``probe failed`` unless it comes back within
the stall bound. It waits in the scheduler's queue like any request, so under load it is
slower: it is the readiness probe, the plain one the liveness probe (docs/serving.md).
Concurrent deep probes share one request, so an open route cannot be used to queue many.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.errors import RequestError, SchedulerDied
from runtime.sampling_params import SamplingParams
from runtime.server.state import ServerState, get_state

# The deep probe's prompt: a word every tokenizer has.
PROBE_TEXT = "ok"


async def health(request: Request) -> Response:
    """200 while the scheduler serves and its loop turns; 503 with the reason otherwise.
    ``?deep=1`` also runs a one-token request through every process."""
    state = get_state(request)
    why = shallow_failure(state)
    warm_up = getattr(request.app.state, "warm_up", None)  # a routed server has none
    if why is None and warm_up is not None and not warm_up.done:
        why = {"status": "warming up"}
    if why is None and request.query_params.get("deep", "0").lower() in ("1", "true", "yes"):
        probe: DeepProbe = request.app.state.deep_probe
        failure = await probe.run(state)
        if failure is not None:
            why = {"status": "probe failed", "error": failure}
    if why is not None:
        return JSONResponse(why, status_code=503)
    return JSONResponse({"status": "ok"})


def shallow_failure(state: ServerState) -> dict[str, str] | None:
    """The 503 body of the plain probe, or None when it passes."""
    manager = state.tokenizer_manager
    if manager.dead:
        return {"status": "dead", "error": manager.dead}
    if not manager.ready.is_set():
        return {"status": "starting"}
    if not manager.serving:  # a routed server whose replicas are all down (restarting)
        return {"status": "no replica serving"}
    heartbeat = state.scheduler_heartbeat
    if heartbeat is not None:
        configured = state.args.health_stall_timeout_s
        silence = heartbeat.stalled_for(configured)
        if silence is not None:
            bound = heartbeat.bound(configured)
            error = (
                f"the scheduler has not finished a loop iteration for {silence:.1f} s "
                f"(the bound is {bound:.1f} s, --health-stall-timeout-s)"
            )
            return {"status": "stalled", "error": error}
    return None


class DeepProbe:
    """Runs the deep probe's request, one at a time: callers that come while one runs share
    its answer."""

    def __init__(self) -> None:
        self._running: asyncio.Task[str | None] | None = None

    async def run(self, state: ServerState) -> str | None:
        """None when a one-token request came back in time, else why it did not."""
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(_one_token(state))
        # Shielded: a caller that hangs up does not cancel the others' probe.
        return await asyncio.shield(self._running)


async def _one_token(state: ServerState) -> str | None:
    manager = state.tokenizer_manager
    timeout = state.args.health_stall_timeout_s
    if state.scheduler_heartbeat is not None:
        timeout = state.scheduler_heartbeat.bound(timeout)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        async with asyncio.timeout(timeout):
            ids = await manager.tokenize(PROBE_TEXT)
            async for _ in manager.generate(ids, params):
                pass
    except TimeoutError:
        return f"a one-token request did not come back within {timeout:.1f} s"
    except (RequestError, SchedulerDied) as exc:
        return f"a one-token request failed: {exc}"
    return None

"""The scheduler never stalls: partial prefills that block each other are broken up."""

from __future__ import annotations

from pathlib import Path

from runtime.channels import QueueChannel
from runtime.ipc import FinishReason, GenerateRequest, TokenOutputBatch
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from runtime.server_args import ServerArgs
from tests.runtime.helpers import random_prompts


def test_blocked_partial_prefills_are_retracted_until_all_finish(tiny_model_path: Path):
    args = ServerArgs(
        model_path=str(tiny_model_path),
        max_total_tokens=320,
        chunked_prefill_size=64,
        max_prefill_tokens=256,
        debug_invariants=True,
    )
    out = QueueChannel()
    scheduler = Scheduler(args, QueueChannel(), out, QueueChannel())
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([200, 200], seed=30)):
        scheduler.handle(GenerateRequest(f"r{i}", prompt, params))
    # Admit both at once as if the pool were huge: their chunks then block each other.
    real = scheduler.kv.available_tokens
    scheduler.kv.available_tokens = lambda: 10_000  # type: ignore[method-assign]
    scheduler.step()
    scheduler.kv.available_tokens = real  # type: ignore[method-assign]
    assert len(scheduler.running) == 2
    for _ in range(200):
        if not scheduler.running and not scheduler.waiting:
            break
        scheduler.step()
    finished = {}
    while (batch := out.recv(0)) is not None:
        assert isinstance(batch, TokenOutputBatch)
        for o in batch.outputs:
            if o.finished_reason is not None:
                finished[o.rid] = o.finished_reason
    assert finished == {"r0": FinishReason.cut(4), "r1": FinishReason.cut(4)}
    assert scheduler.decodes.num_retracted >= 1
    scheduler.kv.check_invariants([])

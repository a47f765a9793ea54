"""Rank 0 of a tensor-parallel group: the scheduler's model runner, which starts the other
ranks and has them follow each forward.

``TensorParallelRunner`` is a ``ModelRunner`` to the scheduler: built from the same
``RunnerConfig``, with the same ``build_batch`` and ``forward``. It starts ranks 1..N-1 as processes
(runtime/tp_worker.py), splits the CPU threads between them and itself, and joins
them in a torch.distributed group. Its ``forward`` first broadcasts the step (the batch's build
arguments and the request-to-slot table's new writes), then runs its own shard of the model;
the workers run theirs, the collectives meet, and rank 0 returns the logits over the whole
vocabulary. ``shutdown`` tells the workers to stop and waits for them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time
from typing import Any

import torch

from runtime.distributed.group import (
    STORE_TIMEOUT,
    check_no_group,
    destroy_tp_group,
    init_tp_group,
    open_store,
    rank_device,
)
from runtime.forward_batch import ForwardBatch
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.tp_worker import DiskCall, Step, WorkerSpec, joined_key

logger = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT_S = 10.0


def start_model_runner(tp_size: int, spec: RunnerConfig) -> ModelRunner:
    """The model runner of a scheduler: a plain ModelRunner for ``tp_size`` 1, else rank 0 of
    ``tp_size`` ranks."""
    if tp_size == 1:
        return ModelRunner(spec)
    return TensorParallelRunner(tp_size, spec)


class TensorParallelRunner(ModelRunner):
    """Rank 0 of ``tp_size`` ranks on ``device`` (CUDA: consecutive GPUs from it). Takes
    a ``RunnerConfig``; this process must not belong to another torch.distributed group.
    Call ``shutdown`` when done (the scheduler does): the workers also exit on their own when
    this process is gone."""

    def __init__(self, tp_size: int, spec: RunnerConfig) -> None:
        if tp_size < 2:
            raise ValueError(f"a tensor-parallel runner needs tp_size >= 2, got {tp_size}")
        check_no_group()  # before starting workers that could never join
        self._threads_before = torch.get_num_threads()
        threads = max(1, self._threads_before // tp_size)
        self._store = open_store(tp_size)
        self._workers: list[subprocess.Popen[bytes]] = []
        self._joined = False
        self._closed = False
        for rank in range(1, tp_size):
            worker = WorkerSpec(
                rank, tp_size, self._store.port, threads, os.getpid(),
                logging.getLogger().getEffectiveLevel(), spec,
            )  # fmt: skip
            self._workers.append(_start_worker(worker))
        try:
            self._wait_for_workers()
            torch.set_num_threads(threads)
            local = torch.device(rank_device(spec.device, 0))
            if local.type == "cuda":
                torch.cuda.set_device(local)
            group = init_tp_group(self._store, 0, tp_size, local)
            self._joined = True
            super().__init__(dataclasses.replace(spec, device=str(local)), tp=group)
        except BaseException as exc:
            dead = self._dead_worker() if isinstance(exc, RuntimeError) else None
            self._close(tell_workers=False)  # they may be inside a collective of their own
            if dead is not None:
                raise RuntimeError(dead) from exc
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Broadcast the step to the workers, then run this rank's forward with them."""
        assert batch.inputs is not None, "batches come from build_batch"
        try:
            self.tp.broadcast(Step(batch.inputs, self.req_to_token_pool.take_writes()))
            return super().forward(batch)
        except RuntimeError as exc:
            dead = self._dead_worker()
            if dead is not None:
                raise RuntimeError(dead) from exc
            raise

    def run_on_workers(self, method: str, *args: Any) -> None:
        """Have every worker's disk tier run ``method(*args)`` now (see ``DiskCall``). Only
        between forwards, never while one runs (the workers wait in the next broadcast)."""
        self.tp.broadcast(DiskCall(method, args))

    def shutdown(self) -> None:
        """Stop the workers (a None step; SIGKILL for any that has not exited in time), leave
        the group and give this process its CPU threads back. Idempotent; call it between
        forwards."""
        self._close(tell_workers=True)

    def _close(self, tell_workers: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if tell_workers and self._joined and all(p.poll() is None for p in self._workers):
            try:
                self.tp.broadcast(None)
            except RuntimeError:
                logger.warning("a tensor-parallel worker did not take the stop message")
        elif not tell_workers:
            for process in self._workers:
                if process.poll() is None:
                    process.terminate()
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
        for rank, process in enumerate(self._workers, start=1):
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d did not stop; killing it", rank)
                process.kill()
                process.wait()
        if self._joined:
            destroy_tp_group()
        torch.set_num_threads(self._threads_before)

    def _wait_for_workers(self) -> None:
        """Return once every worker is up and joining; raise if one exits or none comes."""
        keys = [joined_key(rank) for rank in range(1, len(self._workers) + 1)]
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not self._store.check(keys):
            for rank, process in enumerate(self._workers, start=1):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {process.returncode} "
                        "while starting (its error is in this process's output)"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel workers did not start in {STORE_TIMEOUT.total_seconds()} s"
                )
            time.sleep(0.02)

    def _dead_worker(self) -> str | None:
        """What to report when a collective failed: which worker exited, if one did."""
        time.sleep(0.2)  # a peer's closed socket may show before its exit code does
        for rank, process in enumerate(self._workers, start=1):
            if process.poll() is not None:
                return f"tensor-parallel rank {rank} exited with code {process.returncode}"
        return None


def _start_worker(spec: WorkerSpec) -> subprocess.Popen[bytes]:
    """A fresh interpreter running ``worker.main`` on ``spec`` (sent pickled on its stdin).
    Not multiprocessing's spawn: that re-runs the caller's main script in the child, which an
    Engine user's script without a ``__main__`` guard cannot take. It inherits this process's
    import path, output and error streams."""
    paths = [p for p in sys.path if p]
    inherited = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([inherited] if inherited else []))}
    process = subprocess.Popen(
        [sys.executable, "-c", "from runtime.tp_worker import main; main()"],
        stdin=subprocess.PIPE,
        env=env,
    )
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process

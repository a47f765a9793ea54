"""Ranks 1..N-1 of a tensor-parallel group: processes that run the leader's forwards.

The leader (rank 0, the scheduler's own process) decides every step. Before each forward it
broadcasts a ``Step``: the arguments it packed the batch from, and its writes to the
request-to-slot table since the last step. A worker replays the writes on its own copy of the
table, packs the same batch, and runs the same forward on its shard of the model, taking part
in the forward's collectives; its logits are not used. A ``None`` step ends the loop.

A worker exits when the leader says so, when a collective fails because the leader is gone,
or (watched by a thread) as soon as its parent process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from runtime.distributed.group import connect_store, destroy_tp_group, init_tp_group, rank_device
from runtime.forward_batch import BatchInputs
from runtime.heap import freeze_startup_heap
from runtime.model_runner import ModelRunner, RunnerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One forward, as the leader broadcasts it."""

    inputs: BatchInputs
    table_writes: list[tuple[int, int, list[int]]]  # ReqToTokenPool.take_writes()


@dataclass(frozen=True)
class DiskCall:
    """A KV disk tier method the leader's tier runs between forwards, for each worker's tier
    to run on its own shard of the pool (runtime/scheduler/disk_tier.py): ``"open"`` (its one
    argument the tier's spec, whose ``open`` builds a worker's tier), then the tier's methods
    by name."""

    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with: its place in the group, where to meet the
    others, its share of the CPU threads, and its model runner's configuration."""

    rank: int
    size: int
    store_port: int
    threads: int
    parent_pid: int
    log_level: int
    runner: RunnerConfig


def joined_key(rank: int) -> str:
    """The store key a worker sets once it is up and about to join the group."""
    return f"arbor/tp/joined/{rank}"


def main() -> None:
    """Entry point of a worker process: its ``WorkerSpec`` comes pickled on stdin."""
    run_worker(pickle.load(sys.stdin.buffer))


def run_worker(spec: WorkerSpec) -> None:
    """Set up logging, the parent watch and the threads, join the group, then follow."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader decides when to stop
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s [{os.getpid()}] %(levelname)s %(name)s (tp rank {spec.rank}): "
        "%(message)s",
    )
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    device = torch.device(rank_device(spec.runner.device, spec.rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store(spec.store_port, spec.size)
    store.set(joined_key(spec.rank), "1")
    group = init_tp_group(store, spec.rank, spec.size, device)
    try:
        runner = ModelRunner(dataclasses.replace(spec.runner, device=str(device)), tp=group)
        freeze_startup_heap(f"tensor-parallel rank {spec.rank}")
        follow(runner)
    except RuntimeError:
        if os.getppid() != spec.parent_pid:
            os._exit(1)  # the leader is gone: its collectives fail; nothing to report
        raise
    finally:
        destroy_tp_group()


def follow(runner: ModelRunner) -> None:
    """Run the leader's steps on ``runner`` (a ModelRunner of a rank other than 0) until the
    leader broadcasts ``None``, and its disk tier's calls on this rank's tier (closed, its
    writes done, at the end)."""
    disk: Any = None
    try:
        while (step := runner.tp.broadcast()) is not None:
            if isinstance(step, DiskCall):
                disk = _run_disk_call(runner, disk, step)
            else:
                _run_step(runner, step)
    finally:
        if disk is not None:
            disk.close()


def _run_disk_call(runner: ModelRunner, disk: Any, call: DiskCall) -> Any:
    """Run ``call`` on this rank's disk tier ``disk``; returns the tier (new after "open")."""
    if call.method == "open":
        (spec,) = call.args
        return spec.open(runner.kv_pool, runner.device.type, runner.tp)
    getattr(disk, call.method)(*call.args)
    return disk


def _run_step(runner: ModelRunner, step: Step) -> None:
    runner.req_to_token_pool.replay(step.table_writes)
    inputs = step.inputs
    batch = runner.build_batch(inputs.rows, inputs.prefix_lens, inputs.new_token_ids, inputs.logits)
    runner.forward(batch)


def _exit_with_parent(parent_pid: int) -> None:
    """Leave as soon as the leader's process is gone (SIGKILL gives it no chance to stop us)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)

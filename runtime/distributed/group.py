"""A tensor-parallel group on torch.distributed: its ranks' collectives, and setting it up.

Every rank of a group runs the same model forward on its shard of the weights. Activations are
summed across ranks with ``all_reduce`` (gloo on CPU, NCCL on CUDA); rank 0, the leader, also
broadcasts each step's batch to the others over a gloo group (Python objects travel on the CPU
even when the model runs on CUDA) and receives the logits with ``gather_to_leader``.

The group is torch.distributed's default process group, so one process takes part in one
tensor-parallel group at a time. Rendezvous goes through a TCP store the leader opens on a free
127.0.0.1 port.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
# Collectives wait this long. A worker waits for the next step in a broadcast for as long as the
# server idles, so the limit must outlast any idle spell; a rank that dies closes its sockets,
# which fails the others' collectives at once instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
# A step message up to this size (a decode step of a few hundred requests) is broadcast in one
# collective: on gloo each costs a fixed ~0.5 ms here whatever its size (docs/scale-out.md).
BROADCAST_BYTES = 32 * 1024
# The store's own operations (workers connecting to it) wait at most this long.
STORE_TIMEOUT = datetime.timedelta(seconds=300)


class TPGroup:
    """Rank ``rank`` of ``size`` ranks. The collectives must be called by every rank, in the
    same order; with ``size`` 1 they do nothing (``SINGLE`` is that group)."""

    def __init__(
        self,
        rank: int,
        size: int,
        device_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self._device_group = device_group
        self._control_group = control_group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self._device_group)
        return tensor

    def gather_to_leader(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` ([..., n], the same shape on each) along the last
        dimension on rank 0: [..., size * n] there, ``tensor`` itself on the other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_leader else None
        dist.gather(tensor, parts, dst=0, group=self._device_group)
        return torch.cat(parts, dim=-1) if parts is not None else tensor

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 sends ``message`` (any picklable object); every rank returns it. A message
        that pickles to under ``BROADCAST_BYTES`` takes one collective, a longer one two."""
        if self.size == 1:
            return message
        head = torch.zeros(BROADCAST_BYTES, dtype=torch.uint8)  # [8-byte length | payload]
        if self.is_leader:
            payload = pickle.dumps(message)
            framed = len(payload).to_bytes(8, "little") + payload
            head[: min(len(framed), BROADCAST_BYTES)] = _as_tensor(framed[:BROADCAST_BYTES])
        dist.broadcast(head, src=0, group=self._control_group)
        framed_len = 8 + int.from_bytes(_as_bytes(head[:8]), "little")
        if framed_len > BROADCAST_BYTES:
            if self.is_leader:
                rest = _as_tensor(framed[BROADCAST_BYTES:])
            else:
                rest = torch.empty(framed_len - BROADCAST_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._control_group)
            head = torch.cat([head, rest])
        if self.is_leader:
            return message
        return pickle.loads(_as_bytes(head[8:framed_len]))

    def min(self, value: int) -> int:
        """The smallest ``value`` any rank passes."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._control_group)
        return int(tensor)


SINGLE = TPGroup(0, 1)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


def open_store(size: int) -> dist.TCPStore:
    """The leader's rendezvous store, on a free port of 127.0.0.1 (``store.port``)."""
    return dist.TCPStore(
        HOST, 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
    )


def connect_store(port: int, size: int) -> dist.TCPStore:
    """A worker's connection to the leader's store."""
    return dist.TCPStore(HOST, port, size, is_master=False, timeout=STORE_TIMEOUT)


def check_no_group() -> None:
    """Raise RuntimeError if this process already belongs to a torch.distributed group."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed process group; a "
            "tensor-parallel engine needs its own (one tensor-parallel engine per process)"
        )


def init_tp_group(store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
    """Join the group as ``rank`` (every rank calls this; it returns once all have). Raises
    RuntimeError if this process already belongs to a torch.distributed group."""
    check_no_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    control = None  # gloo's default group carries the CPU messages too
    if backend != "gloo":
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size, None, control)


def destroy_tp_group() -> None:
    """Leave the group (this process may then join another)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: str, rank: int) -> str:
    """The device rank ``rank`` runs on: CUDA ranks take consecutive GPUs from the one named
    (``cuda`` is ``cuda:0``); CPU ranks all run on the CPU."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    return f"cuda:{int(index or 0) + rank}"

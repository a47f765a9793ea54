"""The KV disk tier under the radix tree: what the pool loses is kept on disk and read back.

The tree's prefixes are cut into chunks of ``chunk_tokens`` (a multiple of the page size, so a
chunk is whole pages however nodes split or merge), chunk ``i`` holding positions
``[i * chunk_tokens, (i + 1) * chunk_tokens)`` and keyed by the hash of the whole prefix up to
its end in its cache salt's namespace (``runtime.kv_disk.chunk_keys``). A chunk's payload is the
K and V of every layer at its slots, in the pool's dtype: ``[layers, 2, chunk_tokens, kv_heads,
head_dim]``. The store (``runtime.kv_disk``) writes and checks the files; this module decides
what to write (``save_run``: the tree's eviction hook, or its inserts with write_through) and
what to read (``plan``, ``load``: the KV manager loads a planned run into fresh slots at
admission), and whether reading pays (``LoadCost``).

Threads: everything here runs on the scheduler's thread, between forwards (the pool is read
and written only then); the store's writer thread gets CPU copies.

Tensor parallelism: each rank holds its shard of every layer's K/V heads, so each rank keeps its
own tier, in its own subfolder. Rank 0's tier decides (what to write, what to load) and has
every other rank's tier run the same call on its shard first (``followers``: the workers' tiers
run it between forwards, runtime/tp_worker.py); a load keeps only the chunks every rank read
(``TPGroup.min``), so a chunk one rank lacks is a miss on all.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from arbor_kernels import gather_kv_chunks

from radix_cache import RadixCache
from runtime.kv_disk import KVDiskStore, chunk_keys
from runtime.kv_disk.staging import StagingArena
from runtime.memory_pool import KVPool
from runtime.model_identity import model_identity
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from runtime.distributed import TPGroup

logger = logging.getLogger(__name__)

# Tokens per chunk, rounded up to a multiple of the page size. A prefix loses the tokens after
# its last whole chunk to recomputation (15 at most), and on the agent and multi-turn
# workloads, whose calls are a few hundred tokens, that loss is most of what separates the
# tier's hit rate from an unbounded cache's (multi-turn on the tiny test model, pool at a
# quarter of the working set: 62% with 64-token chunks, 67% with 16, 69% unbounded). 16 tokens
# of SmolLM2-135M's float32 K/V are 740 KB: a file still large enough that reading it runs at
# the disk's streaming speed and its per-file costs (open, rename, checksum setup) stay small;
# a run's chunks are gathered and scattered together (two ops per layer).
CHUNK_TOKENS = 16
# Chunk files hinted for read-ahead per arriving request (a 4,096-token prompt's).
READ_AHEAD_CHUNKS = 256
# Host memory kept for chunks on their way to the writer (write_back), allocated at start:
# reused, it spares the scheduler's thread a page fault per 4 KB of every copy; 44 of SmolLM2's
# 16-token chunks (a step of the write-path benchmark evicts 8 or 9). A copy that finds too few
# entries free (the writer is behind) takes fresh memory instead.
STAGING_BYTES = 32 << 20
# Keys handed to the writer recently: not written yet, so ``contains`` cannot tell.
_RECENT_KEYS = 4096


def chunk_tokens_for(page_size: int) -> int:
    """The chunk size: CHUNK_TOKENS rounded up to whole pages."""
    return -(-CHUNK_TOKENS // page_size) * page_size


class LoadCost:
    """Whether loading a run from disk beats recomputing it, from measured speeds.

    Loading costs ``bytes * load_s_per_byte`` (its prior a slow disk, 200 MB/s, then the mean of
    this tier's loads); recomputing costs ``tokens * recompute_s_per_token`` (its prior 1 ms a
    token on CPU, a small model on a few cores, 20 us on GPU; then measured from this
    scheduler's prefill forwards). Both means are exponentially weighted, so they follow a
    disk whose page cache warms up or a machine whose load changes.
    """

    PRIOR_LOAD_S_PER_BYTE = 1 / 200e6
    PRIOR_RECOMPUTE_S_PER_TOKEN = {"cpu": 1e-3, "cuda": 2e-5}
    WEIGHT = 0.2  # of a new measurement in the mean
    MIN_PREFILL_TOKENS = 32  # smaller forwards are mostly fixed costs, not per-token ones

    def __init__(self, device_type: str) -> None:
        self.load_s_per_byte = self.PRIOR_LOAD_S_PER_BYTE
        self.recompute_s_per_token = self.PRIOR_RECOMPUTE_S_PER_TOKEN.get(device_type, 1e-3)

    def pays(self, tokens: int, nbytes: int) -> bool:
        return nbytes * self.load_s_per_byte < tokens * self.recompute_s_per_token

    def observe_load(self, seconds: float, nbytes: int) -> None:
        if nbytes > 0:
            self.load_s_per_byte = self._mean(self.load_s_per_byte, seconds / nbytes)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """A forward of ``tokens`` rows, mostly prefill, took ``seconds``."""
        if tokens >= self.MIN_PREFILL_TOKENS:
            self.recompute_s_per_token = self._mean(self.recompute_s_per_token, seconds / tokens)

    def _mean(self, old: float, new: float) -> float:
        return (1 - self.WEIGHT) * old + self.WEIGHT * new


@dataclass(frozen=True)
class DiskRun:
    """Chunks on disk that continue a cached prefix: chunk ``first`` onward, ``keys`` in
    order; they cover positions up to ``end``."""

    first: int
    keys: list[str]
    chunk_tokens: int

    @property
    def end(self) -> int:
        return (self.first + len(self.keys)) * self.chunk_tokens


@dataclass
class DiskTierStats:
    hits_tokens: int = 0  # prompt tokens loaded from disk instead of recomputed
    loads: int = 0  # chunks loaded
    load_bytes: int = 0
    load_seconds: float = 0.0
    skipped_runs: int = 0  # runs on disk that recomputing was expected to beat


class DiskFollowers(Protocol):
    """The other ranks' tiers, as rank 0's tier reaches them."""

    def __call__(self, method: str, *args: Any) -> None:
        """Have each of them run ``method(*args)`` now, on its own shard."""


class KVDiskTier:
    """Chunks of one pool's KV on disk. ``always_load``: load whatever is on disk (tests);
    else only what ``cost`` says pays. ``group``: the tensor-parallel group whose ranks agree
    on what a load read (rank 0 sets ``followers``)."""

    def __init__(
        self,
        store: KVDiskStore,
        pool: KVPool,
        chunk_tokens: int,
        *,
        write_through: bool,
        always_load: bool,
        device_type: str,
        group: TPGroup | None = None,
    ) -> None:
        self.store = store
        self.group = group
        self.followers: DiskFollowers | None = None
        self.pool = pool
        self.chunk_tokens = chunk_tokens
        self.write_through = write_through
        self.always_load = always_load
        self.cost = LoadCost(device_type)
        self.stats = DiskTierStats()
        self._recent: OrderedDict[str, None] = OrderedDict()
        k = pool.k_buffers[0]  # [slots, kv_heads, head_dim]
        self.chunk_shape = (pool.num_layers, 2, chunk_tokens, *k.shape[1:])
        self.chunk_bytes = int(np.prod(self.chunk_shape)) * k.element_size()
        # Host buffers for write_back's copies: CPU pools only (a GPU pool's chunks are
        # gathered on the GPU, then copied to fresh host memory), and none when one chunk is
        # larger than STAGING_BYTES.
        entries = STAGING_BYTES // self.chunk_bytes if k.device.type == "cpu" else 0
        self.staging = StagingArena(self.chunk_shape, k.dtype, entries) if entries else None

    # ---- writing ----------------------------------------------------------------------------

    def save_run(
        self, namespace: Hashable, tokens: np.ndarray, slots: np.ndarray, start: int
    ) -> None:
        """Queue for writing the chunks that end inside ``[start, len(tokens))`` of a
        root-to-node path (``slots``: their KV, valid now) and that the store does not hold
        yet: the tree's eviction hook, and its inserts with write_through."""
        if self.followers is not None:
            self.followers("save_run", namespace, tokens, slots, start)
        self._save(namespace, tokens, slots, start, wait=False)

    def save_now(
        self, namespace: Hashable, tokens: np.ndarray, slots: np.ndarray, start: int
    ) -> None:
        """``save_run``, written before this returns (``save_tree``, on each rank)."""
        if self.followers is not None:
            self.followers("save_now", namespace, tokens, slots, start)
        self._save(namespace, tokens, slots, start, wait=True)

    def save_tree(self, tree: RadixCache) -> None:
        """Write every chunk ``tree`` holds that the store does not (a graceful stop), each
        before the next: the write queue's bound would drop most of a large cache."""
        tree.report_runs(self.save_now)

    def _save(
        self, namespace: Hashable, tokens: np.ndarray, slots: np.ndarray, start: int, wait: bool
    ) -> None:
        if namespace is not None and not isinstance(namespace, str):
            return  # not a cache salt: KV this tier does not key
        if self.store.writes_paused:
            return  # nothing would be written (a write failed lately): spare the copies
        size = self.chunk_tokens
        first, last = start // size, tokens.size // size
        if first >= last:
            return
        ids = np.asarray(tokens[: last * size], dtype=np.int64)
        keys = chunk_keys(ids, size, namespace)
        todo = [i for i in range(first, last) if not self._held(keys[i])]
        if not todo:
            return
        index = np.concatenate([slots[i * size : (i + 1) * size] for i in todo])
        staging = None if wait else self.staging
        entries = None if staging is None else staging.take(len(todo))
        payloads = self._gather(index, len(todo), entries)
        for n, (i, payload) in enumerate(zip(todo, payloads, strict=True)):
            key, span = keys[i], slice(i * size, (i + 1) * size)
            if wait:
                self.store.put(key, ids[span], payload)
                continue
            release = None
            if staging is not None and entries is not None:
                release = partial(staging.give_back, entries[n])
            if self.store.put_async(key, ids[span].copy(), payload, release):
                self._recent[key] = None
                if len(self._recent) > _RECENT_KEYS:
                    self._recent.popitem(last=False)

    def _held(self, key: str) -> bool:
        """Whether the chunk ``key`` is stored, or queued for writing."""
        return key in self._recent or self.store.contains(key)

    def _gather(
        self, slots: np.ndarray, chunks: int, entries: list[int] | None
    ) -> list[torch.Tensor]:
        """CPU copies of the K/V at ``slots`` (``chunks`` whole chunks' slots, in order), one
        contiguous payload per chunk: ``[layers, 2, chunk_tokens, kv_heads, head_dim]`` each.
        One op (``kernels.gather_kv_chunks``) copies them into the staging arena's
        ``entries`` (one per chunk; CPU pools only), else into fresh memory on the pool's
        device, then to the host."""
        k0 = self.pool.k_buffers[0]
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(k0.device)
        if entries is not None:
            assert self.staging is not None
            arena = self.staging.buffer  # [capacity, layers, 2, chunk_tokens, heads, dim]
            rows = torch.tensor(entries, dtype=torch.int64)
            gather_kv_chunks(arena, rows, self.pool.k_buffers, self.pool.v_buffers, index)
            return [arena[entry] for entry in entries]
        out = torch.empty((chunks, *self.chunk_shape), dtype=k0.dtype, device=k0.device)
        rows = torch.arange(chunks, dtype=torch.int64, device=k0.device)
        gather_kv_chunks(out, rows, self.pool.k_buffers, self.pool.v_buffers, index)
        return list(out.cpu().unbind(0))

    # ---- reading ----------------------------------------------------------------------------

    def keys(
        self, token_ids: np.ndarray, salt: str | None, known: list[str] | None = None
    ) -> list[str]:
        """The chunk keys of ``token_ids`` (its whole chunks), reusing ``known``: what an
        earlier call returned for a prefix of the same tokens and salt."""
        return chunk_keys(token_ids, self.chunk_tokens, salt, known or ())

    def read_ahead(self, keys: list[str], first: int) -> int:
        """Hint the kernel to read the files of the chunks ``keys[first:]`` that the tier holds
        (at most READ_AHEAD_CHUNKS; ``first``: the chunk where the prefix in memory ends) while
        the request waits for admission: with a cold page cache the disk then reads them in
        parallel with the forwards instead of one by one at admission. Returns the chunks
        hinted."""
        return self.store.read_ahead(keys[first : first + READ_AHEAD_CHUNKS])

    def plan(self, keys: list[str], cached_len: int) -> DiskRun | None:
        """The chunks on disk that continue the ``cached_len`` tokens in memory of the tokens
        whose chunk ``keys`` these are (up to their last whole chunk), if loading them pays;
        else None."""
        size = self.chunk_tokens
        first = cached_len // size
        run: list[str] = []
        for key in keys[first:]:
            if not self.store.contains(key):
                break
            run.append(key)
        if not run:
            return None
        tokens = (first + len(run)) * size - cached_len
        if not self.always_load and not self.cost.pays(tokens, len(run) * self.chunk_bytes):
            self.stats.skipped_runs += 1
            return None
        return DiskRun(first, run, size)

    def load(self, run: DiskRun, token_ids: np.ndarray, start: int, slots: torch.Tensor) -> int:
        """Read ``run``'s chunks into the pool at ``slots`` (positions ``[start, run.end)``),
        in order, until one is missing, corrupt or not what the pool holds. Returns the
        position loaded up to (``start`` when nothing was).

        Each chunk file is read straight into its place in one host staging tensor; the
        chunks read are then written into the pool with two ops per layer, whatever their
        number."""
        if self.followers is not None:
            self.followers("load", run, token_ids, start, slots.clone())
        size = self.chunk_tokens
        began = time.perf_counter()
        staging = torch.empty((len(run.keys), *self.chunk_shape), dtype=self.pool.dtype)
        read = 0
        for i, key in enumerate(run.keys):
            chunk_start = (run.first + i) * size
            ids = np.asarray(token_ids[chunk_start : chunk_start + size], dtype=np.int64)
            if not self.store.get_into(key, ids, staging[i]):
                break
            read += 1
        if self.group is not None:
            read = self.group.min(read)  # a chunk one rank could not read is a miss on all
        if read == 0:
            return start
        end = (run.first + read) * size
        # The first chunk may begin inside the prefix already in memory: its tail only.
        offset = start - run.first * size
        self._scatter(staging[:read], offset, slots[: end - start])
        seconds = time.perf_counter() - began
        nbytes = read * self.chunk_bytes
        self.cost.observe_load(seconds, nbytes)
        self.stats.loads += read
        self.stats.load_bytes += nbytes
        self.stats.load_seconds += seconds
        self.stats.hits_tokens += end - start
        return end

    def _scatter(self, payloads: torch.Tensor, offset: int, slots: torch.Tensor) -> None:
        """Write the positions from ``offset`` on of ``payloads`` (``[chunks, layers, 2,
        chunk_tokens, kv_heads, head_dim]``, CPU: consecutive chunks) at ``slots``."""
        k0 = self.pool.k_buffers[0]
        slots = slots.to(k0.device)
        chunks = payloads.shape[0]
        for layer in range(self.pool.num_layers):
            for kind, buffers in enumerate((self.pool.k_buffers, self.pool.v_buffers)):
                rows = payloads[:, layer, kind].reshape(chunks * self.chunk_tokens, *k0.shape[1:])
                buffers[layer][slots] = rows[offset:].to(k0.device)

    # ---- upkeep -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Delete every chunk (``flush_cache`` with disk)."""
        if self.followers is not None:
            self.followers("clear")
        self.store.flush()
        self.store.clear()
        self._recent.clear()

    def close(self) -> None:
        """Wait for queued writes, stop the writer, release the folder."""
        self.store.close()

    def info(self) -> dict[str, Any]:
        """The tier's counters under the names server_info and /metrics use."""
        store = self.store.stats()
        return {
            "kv_disk_hits_tokens": self.stats.hits_tokens,
            "kv_disk_loads": self.stats.loads,
            "kv_disk_load_bytes": self.stats.load_bytes,
            "kv_disk_load_seconds": self.stats.load_seconds,
            "kv_disk_writes": int(store.get("writes", 0)),
            "kv_disk_write_bytes": int(store.get("write_bytes", 0)),
            "kv_disk_write_errors": int(store.get("write_errors", 0)),
            "kv_disk_used_bytes": int(store.get("used_bytes", 0)),
            "kv_disk_chunks": int(store.get("chunks", 0)),
            "kv_disk_dropped_writes": int(store.get("dropped_writes", 0)),
            "kv_disk_writes_paused": int(store.get("writes_paused", 0)),
            "kv_disk_skipped_runs": self.stats.skipped_runs,
            "kv_disk_load_s_per_mb": self.cost.load_s_per_byte * 1e6,
            "kv_disk_recompute_s_per_token": self.cost.recompute_s_per_token,
        }


# server_info's tier counters when there is no tier (so /metrics always has them).
NO_TIER_INFO = {
    "kv_disk_hits_tokens": 0,
    "kv_disk_loads": 0,
    "kv_disk_load_bytes": 0,
    "kv_disk_load_seconds": 0.0,
    "kv_disk_writes": 0,
    "kv_disk_write_bytes": 0,
    "kv_disk_write_errors": 0,
    "kv_disk_used_bytes": 0,
}


def disk_manifest(
    args: ServerArgs, quantization: str, chunk_tokens: int, tp_rank: int = 0
) -> dict[str, Any]:
    """What makes stored KV valid for rank ``tp_rank`` of this server (``args`` with device
    defaults filled in)."""
    return {
        "model": model_identity(args.model_path),
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": quantization,
        "page_size": args.page_size,
        "chunk_tokens": chunk_tokens,
        "tp_size": args.tp_size,
        "tp_rank": tp_rank,
    }


@dataclass(frozen=True)
class DiskTierSpec:
    """What a rank needs to open its tier (picklable: rank 0 sends it to the others)."""

    path: str
    max_bytes: int
    manifest: dict[str, Any]  # rank 0's; each rank's says its own tp_rank
    chunk_tokens: int
    write_through: bool
    always_load: bool
    replica: int
    tp_size: int

    def subfolder(self, tp_rank: int) -> str:
        """``replica{i}``, and with tensor parallelism ``replica{i}-rank{r}``."""
        replica = f"replica{self.replica}"
        return replica if self.tp_size == 1 else f"{replica}-rank{tp_rank}"

    def open(self, pool: KVPool, device_type: str, group: TPGroup | None = None) -> KVDiskTier:
        """This rank's tier on its shard ``pool`` (rank ``group.rank``; 0 without a group).
        Raises KVDiskError when the folder is locked by another server or unusable."""
        rank = group.rank if group is not None else 0
        store = KVDiskStore(
            Path(self.path).expanduser(),
            self.max_bytes,
            {**self.manifest, "tp_rank": rank},
            subfolder=self.subfolder(rank),
        )
        return KVDiskTier(
            store,
            pool,
            self.chunk_tokens,
            write_through=self.write_through,
            always_load=self.always_load,
            device_type=device_type,
            group=group if self.tp_size > 1 else None,
        )


def disk_tier_spec(args: ServerArgs, quantization: str, replica: int = 0) -> DiskTierSpec:
    """The tier ``args`` ask for (``kv_disk_path`` set), for replica ``replica``."""
    assert args.kv_disk_path is not None
    chunk = chunk_tokens_for(args.page_size)
    return DiskTierSpec(
        path=args.kv_disk_path,
        max_bytes=int(args.kv_disk_max_gb * (1 << 30)),
        manifest=disk_manifest(args, quantization, chunk),
        chunk_tokens=chunk,
        write_through=args.kv_disk_write_policy == "write_through",
        always_load=args.kv_disk_load_policy == "always",
        replica=replica,
        tp_size=args.tp_size,
    )


def open_disk_tier(
    args: ServerArgs, pool: KVPool, quantization: str, device_type: str, replica: int = 0
) -> KVDiskTier:
    """Rank 0's tier of the tier ``args`` ask for (``kv_disk_path`` set), on the folder's
    ``replica{replica}`` subfolder. Raises KVDiskError when the folder is locked by another
    server or unusable."""
    return disk_tier_spec(args, quantization, replica).open(pool, device_type)

"""SGLang's pure-Python ``RadixCache`` as the radix-cache benchmark's baseline (optional).

SGLang is never a dependency: its wheel is installed, without its dependencies, into a
throwaway folder that the benchmark is pointed at::

    pip install --no-deps --target /tmp/arbor-sglang sglang

Only the modules the cache runs are loaded from that folder: ``radix_cache`` (the tree, its
keys and nodes), ``base_prefix_cache`` (its base class and parameter types), ``evict_policy``
and ``utils`` (the eviction strategies), ``events`` (the KV event recorder, left disabled)
and ``cache_init_params``. Every other SGLang module they import (kernels, the scheduler,
metrics, environment flags) is replaced by a placeholder whose names raise if the benchmark
ever calls one, so the numbers are those of SGLang's own code and nothing else of SGLang runs.
No SGLang code is copied into this repository.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from benchmarks.radix_replay import OPS, Replay, TraceRequest, op_summary, replay_all
from radix_cache import KVSlotAllocator, MatchResult

DEFAULT_DIR = Path("/tmp/arbor-sglang")
INSTALL_HINT = "pip install --no-deps --target {dir} sglang"
_REAL_MODULES = frozenset(
    f"sglang.srt.mem_cache.{name}"
    for name in (
        "radix_cache",
        "base_prefix_cache",
        "cache_init_params",
        "events",
        "evict_policy",
        "utils",
    )
)


class SGLangUnavailable(RuntimeError):
    """The folder holds no SGLang wheel this benchmark can load."""


class _Placeholder(ModuleType):
    """An SGLang module the cache imports but the benchmark never runs."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")


def _absent(qualified: str) -> type:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{qualified} is a placeholder: the SGLang baseline does not load it")

    return type(qualified.rsplit(".", 1)[1], (), {"__init__": refuse})


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _Placeholder(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = []  # a package, so that submodules resolve to placeholders too


class _Finder(importlib.abc.MetaPathFinder):
    """Serves every ``sglang`` module: the cache's own from ``root``, placeholders otherwise
    (no package ``__init__`` of SGLang runs)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in _REAL_MODULES:
            file = self.root.joinpath(*fullname.split(".")).with_suffix(".py")
            return importlib.util.spec_from_file_location(fullname, file)
        return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)


@functools.cache
def load(root: Path) -> tuple[ModuleType, ModuleType, str]:
    """(radix_cache module, base_prefix_cache module, SGLang version) from the folder ``root``
    that ``INSTALL_HINT`` filled; SGLangUnavailable saying what to run when it is not there.
    Loaded once per process."""
    source = root / "sglang" / "srt" / "mem_cache" / "radix_cache.py"
    if not source.is_file():
        raise SGLangUnavailable(
            f"no SGLang in {root}; to compare with it: {INSTALL_HINT.format(dir=root)}"
        )
    versions = [d.version for d in importlib.metadata.distributions(path=[str(root)])]
    if any(name == "sglang" or name.startswith("sglang.") for name in sys.modules):
        raise SGLangUnavailable("another sglang is already imported in this process")
    finder = _Finder(root)
    sys.meta_path.insert(0, finder)
    try:
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    except Exception as exc:  # a newer SGLang may need more than this loader gives it
        raise SGLangUnavailable(f"SGLang in {root} did not load: {exc!r}") from exc
    finally:
        sys.meta_path.remove(finder)
    return radix, base, versions[0] if versions else "unknown"


def native_ids(ids: np.ndarray) -> array:
    """Token ids the way SGLang's scheduler keeps them (``array('q')``)."""
    native = array("q")
    native.frombytes(ids.astype(np.int64).tobytes())
    return native


class _PoolAllocator:
    """What SGLang's tree calls on its KV allocator (the device and freeing evicted slots),
    backed by the benchmark's slot allocator."""

    device = "cpu"

    def __init__(self, allocator: KVSlotAllocator) -> None:
        self.allocator = allocator

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.allocator.free(slots)


class SGLangCache:
    """SGLang's RadixCache (page size 1, LRU) behind the five calls the replay makes, each one
    SGLang call (two for a match: the match and the path's KV indices, as its scheduler reads
    a prefix's slots). Ids come as ``array('q')``, slots as int64 tensors: its native input."""

    def __init__(self, modules: tuple[ModuleType, ModuleType], allocator: KVSlotAllocator) -> None:
        if allocator.page_size != 1:
            raise ValueError("the SGLang baseline runs with page size 1")
        radix, base = modules
        self.allocator = allocator
        self.tree = radix.RadixCache.create_simulated(mock_allocator=_PoolAllocator(allocator))
        self._key, self._match = radix.RadixKey, base.MatchPrefixParams
        self._insert, self._evict = base.InsertParams, base.EvictParams

    def match_prefix(self, ids: array) -> MatchResult:
        found = self.tree.match_prefix(self._match(key=self._key(ids)))
        node = found.last_device_node
        return MatchResult(self.tree.path_device_indices(node), found.device_prefix_len, node)

    def insert(self, ids: array, slots: torch.Tensor) -> int:
        return int(self.tree.insert(self._insert(key=self._key(ids), value=slots)).prefix_len)

    def evict(self, num_tokens: int) -> int:
        return int(self.tree.evict(self._evict(num_tokens=num_tokens)).num_tokens_evicted)

    def lock(self, node: Any) -> None:
        self.tree.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.tree.dec_lock_ref(node)

    def cached_tokens(self) -> int:
        return int(self.tree.total_size())


def run_replay(trace: list[TraceRequest], num_slots: int, root: Path) -> dict:
    """The page-1 replay through SGLang's RadixCache (LRU, its default)."""
    radix, base, version = load(root)
    cache = SGLangCache((radix, base), KVSlotAllocator(num_slots))
    replay = Replay(cache, native_ids)
    wall = replay_all(replay, trace)
    held = cache.allocator.available() + cache.cached_tokens() + replay.private_slots().numel()
    if held != cache.allocator.capacity:  # the same no-leak check, by counting
        raise RuntimeError(f"SGLang replay: {held} slots accounted for, not {num_slots - 1}")
    timer = replay.timer
    queried = timer.tokens["match_prefix"]
    return {
        "sglang_version": version,
        "requests": len(trace),
        "cache_ops": sum(timer.calls[op] for op in OPS),
        "wall_s": wall,
        "hit_rate": replay.hit_tokens / max(queried, 1),
        "evicted_tokens": timer.tokens["evict"],
        "cached_tokens": cache.cached_tokens(),
        "ops": op_summary(timer),
    }


def comparison(ours: dict, theirs: dict) -> dict:
    """Ops/s of both sides per op, and of insert + match together (the target: >= 2x)."""

    def combined(ops: dict) -> float:
        calls = ops["match_prefix"]["calls"] + ops["insert"]["calls"]
        return calls / (ops["match_prefix"]["seconds"] + ops["insert"]["seconds"])

    rows = {op: (ours["ops"][op]["ops_per_s"], theirs["ops"][op]["ops_per_s"]) for op in OPS}
    rows["insert+match"] = (combined(ours["ops"]), combined(theirs["ops"]))
    return {
        op: {"arbor_ops_per_s": a, "sglang_ops_per_s": b, "speedup": a / b}
        for op, (a, b) in rows.items()
    }


def print_comparison(ours: dict, theirs: dict, table: dict) -> None:
    print(f"\nArbor vs SGLang {theirs['sglang_version']} RadixCache, page 1, LRU, same trace")
    print(f"{'op':<13} {'arbor ops/s':>12} {'sglang ops/s':>13} {'speedup':>8}")
    for op, row in table.items():
        print(
            f"{op:<13} {row['arbor_ops_per_s']:>12.0f} {row['sglang_ops_per_s']:>13.0f} "
            f"{row['speedup']:>7.2f}x"
        )
    for name, r in (("arbor", ours), ("sglang", theirs)):
        print(
            f"{name:<7} hit rate {r['hit_rate']:.3f}, evicted {r['evicted_tokens']} tokens, "
            f"{r['cache_ops']} cache ops, wall {r['wall_s']:.2f} s"
        )

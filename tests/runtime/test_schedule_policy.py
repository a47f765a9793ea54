"""Waiting-queue order: longest prefix first, DFS by subtree weight, starvation override."""

from __future__ import annotations

import time

import torch

from radix_cache import KVSlotAllocator, RadixCache
from runtime.ipc import GenerateRequest
from runtime.memory_pool import ReqToTokenPool
from runtime.sampling_params import SamplingParams
from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.req import Req
from runtime.scheduler.schedule_policy import make_policy, with_starved_first


def _kv_with(cached: list[list[int]]) -> KVCacheManager:
    allocator = KVSlotAllocator(1024)
    tree = RadixCache(allocator)
    for ids in cached:
        tree.insert(ids, allocator.alloc(len(ids)))
    return KVCacheManager(allocator, tree, ReqToTokenPool(4, 256, torch.device("cpu")))


def _req(rid: str, ids: list[int]) -> Req:
    return Req(GenerateRequest(rid, ids, SamplingParams()), seed=0)


def test_lpm_orders_by_cached_prefix_and_falls_back_to_fcfs():
    kv = _kv_with([list(range(100)), [7] * 50])
    waiting = [
        _req("none", [1, 2, 3]),
        _req("short", [7] * 20 + [1]),
        _req("long", list(range(90)) + [5]),
    ]
    assert [r.rid for r in make_policy("lpm", 128).order(waiting, kv)] == ["long", "short", "none"]
    assert [r.rid for r in make_policy("lpm", 2).order(waiting, kv)] == ["none", "short", "long"]


def test_dfs_weight_groups_requests_under_the_heaviest_subtree():
    kv = _kv_with([[1] * 40, [2] * 40])
    waiting = [
        _req("a1", [1] * 40 + [3]),
        _req("b1", [2] * 40 + [3]),
        _req("b2", [2] * 40 + [4]),
        _req("a0", [9]),
    ]
    order = [r.rid for r in make_policy("dfs-weight", 128).order(waiting, kv)]
    assert order.index("b1") < order.index("a1") and order.index("b2") < order.index("a1")
    assert abs(order.index("b1") - order.index("b2")) == 1


def test_starved_requests_go_first():
    old, new = _req("old", [1]), _req("new", [2])
    old.arrival = time.monotonic() - 100
    assert [r.rid for r in with_starved_first([new, old], 10.0)] == ["old", "new"]
    assert [r.rid for r in with_starved_first([new, old], 1000.0)] == ["new", "old"]

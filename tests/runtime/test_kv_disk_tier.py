"""The KV disk tier (``--kv-disk-path``, issue 40) on the in-process Engine and the tiny test
model: outputs with the tier equal outputs without it while evictions and loads happen, a
restarted engine serves from disk, a manifest mismatch, a corrupt chunk, a chunk file moved
under another key or a FIFO in the tier is a miss (issue 51), tenants never load each other's
chunks, the KV accounting holds, a write error keeps serving, and bad flags are refused at
start."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtime import Engine
from runtime.kv_disk import KVDiskError, chunk_keys
from runtime.kv_disk import store as kv_disk_store
from runtime.kv_disk.folder import chunk_path
from runtime.memory_pool import KVPool
from runtime.model_identity import model_identity
from runtime.scheduler import disk_tier
from runtime.scheduler.disk_tier import CHUNK_TOKENS, LoadCost, disk_manifest, open_disk_tier
from runtime.server_args import ServerArgs
from tests.runtime.helpers import random_prompts

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
# A pool of 1024 tokens and prompts of ~400: each round of four prompts evicts the last.
POOL = {"max_total_tokens": 1024, "max_running_requests": 2, "debug_invariants": True}
TIER = {"kv_disk_load_policy": "always"}


def _run(engine: Engine, prompts: list[list[int]], salt: str | None = None) -> list[Any]:
    """Each prompt alone, in order: (output ids, cached_tokens) per prompt."""
    results = []
    for prompt in prompts:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt=salt)
        results.append((out["output_ids"], int(out["meta_info"]["cached_tokens"])))
    return results


def _prompts() -> list[list[int]]:
    return random_prompts([400, 420, 390, 410], seed=40)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> list[list[int]]:
    """The outputs of each prompt without any cache."""
    with Engine(tiny_model_path, disable_radix_cache=True, **POOL) as engine:
        return [ids for ids, _ in _run(engine, _prompts())]


@pytest.fixture
def tier_engine(tiny_model_path: Path, tmp_path: Path) -> Iterator[Engine]:
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        yield engine


def _info(engine: Engine) -> dict[str, Any]:
    return engine.get_server_info()


def _saved_prompt(model: Path, folder: Path) -> list[int]:
    """A prompt run once by an engine on ``folder``, whose shutdown saved its chunks there."""
    prompt = _prompts()[0]
    with Engine(model, kv_disk_path=str(folder), **POOL, **TIER) as engine:
        _run(engine, [prompt])
    return prompt


def test_evicted_prefixes_load_from_disk_with_identical_outputs(
    tier_engine: Engine, reference: list[list[int]]
) -> None:
    prompts = _prompts()
    first = _run(tier_engine, prompts)
    assert [ids for ids, _ in first] == reference
    assert _info(tier_engine)["kv_disk_loads"] == 0
    # The pool holds two of the four prompts: the first ones went to disk.
    second = _run(tier_engine, prompts)
    assert [ids for ids, _ in second] == reference
    info = _info(tier_engine)
    assert info["kv_disk_writes"] > 0 and info["kv_disk_loads"] > 0
    assert info["kv_disk_hits_tokens"] >= 384  # at least one prompt's whole chunks
    # cached_tokens counts the disk's tokens: whole chunks of every prompt, not recomputed.
    for prompt, (_, cached) in zip(prompts, second, strict=True):
        assert cached >= len(prompt) - 1 - (CHUNK_TOKENS - 1), (cached, len(prompt))
    tier_engine.check_invariants()


def test_restart_serves_from_disk(
    tiny_model_path: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    prompts = _prompts()
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        _run(engine, prompts)
    # Shutdown saved what the pool still held: every prompt is on disk.
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        again = _run(engine, prompts)
        info = _info(engine)
        engine.check_invariants()
    assert [ids for ids, _ in again] == reference
    assert info["kv_disk_loads"] >= 4 * (384 // CHUNK_TOKENS)
    assert all(cached >= 384 for _, cached in again)


def test_an_arriving_request_reads_its_chunks_ahead(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = _saved_prompt(tiny_model_path, tmp_path)
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        assert engine.scheduler.disk is not None
        store = engine.scheduler.disk.store
        hinted: list[int] = []
        read_ahead = store.read_ahead

        def recording(keys: list[str]) -> int:
            hinted.append(read_ahead(keys))
            return hinted[-1]

        monkeypatch.setattr(store, "read_ahead", recording)
        _run(engine, [prompt])
    # Every whole chunk of the prompt (its last token is computed), hinted on arrival.
    assert hinted == [(len(prompt) - 1) // CHUNK_TOKENS]


def test_a_request_hashes_its_chunks_once_and_hints_only_what_memory_lacks(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = _saved_prompt(tiny_model_path, tmp_path)
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        disk = engine.scheduler.disk
        assert disk is not None
        held = 200  # a request that shares the prompt's first 200 tokens puts them in memory
        _run(engine, [prompt[:held] + [7, 8, 9]])
        hashed: list[int] = []  # chunks hashed, per call
        hinted: list[list[str]] = []
        real_keys, real_read_ahead = disk_tier.chunk_keys, disk.store.read_ahead

        def counting_keys(token_ids: Any, size: int, salt: Any, known: Any = ()) -> list[str]:
            keys = real_keys(token_ids, size, salt, known)
            hashed.append(len(keys) - len(known))
            return keys

        def recording(keys: list[str]) -> int:
            hinted.append(keys)
            return real_read_ahead(keys)

        monkeypatch.setattr(disk_tier, "chunk_keys", counting_keys)
        monkeypatch.setattr(disk.store, "read_ahead", recording)
        before = _info(engine)["kv_disk_hits_tokens"]
        [(_, cached)] = _run(engine, [prompt])
        loaded = _info(engine)["kv_disk_hits_tokens"] - before
        hashed_for_request = sum(hashed)  # (the shutdown's save hashes more)
    chunks = (len(prompt) - 1) // CHUNK_TOKENS  # its last token is computed
    # Each chunk hashed once: on arrival, not again at admission.
    assert hashed_for_request == chunks
    keys = chunk_keys(np.asarray(prompt[: chunks * CHUNK_TOKENS]), CHUNK_TOKENS, None)
    # Hinted: from the chunk where memory's 200 tokens end (its tail is loaded) to the last.
    assert hinted == [keys[held // CHUNK_TOKENS :]]
    assert cached == chunks * CHUNK_TOKENS and loaded == cached - held


def test_tensor_parallel_ranks_keep_their_own_shards_and_restart_warm(
    tiny_model_path: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    prompts = _prompts()
    tp = {"tp_size": 2, **POOL, **TIER}
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **tp) as engine:
        first = _run(engine, prompts + prompts)  # the second round loads what the first evicted
        info = _info(engine)
        engine.check_invariants()
    assert [ids for ids, _ in first] == reference + reference
    assert info["kv_disk_loads"] > 0
    folders = [tmp_path / f"replica0-rank{rank}" for rank in (0, 1)]
    for rank, folder in enumerate(folders):
        manifest = json.loads((folder / "manifest.json").read_text())
        assert (manifest["tp_size"], manifest["tp_rank"]) == (2, rank)
    names = [sorted(p.name for p in folder.rglob("*.kv")) for folder in folders]
    assert names[0] == names[1] and len(names[0]) >= 4 * (384 // CHUNK_TOKENS)
    # Rank 1 loses chunk 5 of the first prompt: that prompt's load stops there on both ranks.
    keys = chunk_keys(np.asarray(prompts[0][:384]), CHUNK_TOKENS, None)
    chunk_path(folders[1], keys[5]).unlink()
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **tp) as engine:
        again = _run(engine, prompts)
        engine.check_invariants()
    assert [ids for ids, _ in again] == reference
    assert again[0][1] == 5 * CHUNK_TOKENS
    assert all(cached >= 384 for _, cached in again[1:])


def test_other_kv_dtype_invalidates_the_tier(tiny_model_path: Path, tmp_path: Path) -> None:
    prompts = _prompts()[:2]
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        expected = _run(engine, prompts)
    kv16 = {**POOL, **TIER, "kv_cache_dtype": "bf16"}
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **kv16) as engine:
        out = _run(engine, prompts)
        assert _info(engine)["kv_disk_loads"] == 0
    assert all(cached == 0 for _, cached in out)
    assert len(out) == len(expected)


def test_corrupt_chunk_is_recomputed(
    tiny_model_path: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    prompts = _prompts()
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        _run(engine, prompts)
    chunks = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert chunks, "no chunk files were written"
    for path in chunks:  # flip bytes in the middle of every payload
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
        path.write_bytes(bytes(data))
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        again = _run(engine, prompts)
        assert _info(engine)["kv_disk_loads"] == 0
        engine.check_invariants()
    assert [ids for ids, _ in again] == reference


def test_a_truncated_chunk_ends_the_run_and_the_rest_is_recomputed(
    tiny_model_path: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    prompt = _prompts()[0]
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        _run(engine, [prompt])
        assert engine.scheduler.disk is not None
        size, folder = engine.scheduler.disk.chunk_tokens, engine.scheduler.disk.store.folder
    # The third chunk's file loses its checksum and half its payload.
    path = chunk_path(folder, chunk_keys(np.array(prompt), size, None)[2])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        ((ids, cached),) = _run(engine, [prompt])
        info = _info(engine)
        engine.check_invariants()
        assert not path.exists()  # a bad file is deleted (until shutdown saves the chunk)
    assert ids == reference[0]
    assert cached == 2 * size  # the two chunks before it, from disk
    assert info["kv_disk_loads"] == 2 and info["kv_disk_hits_tokens"] == 2 * size


def test_a_chunk_file_moved_under_another_prefix_is_a_miss_and_deleted(
    tiny_model_path: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """Two prompts whose chunk 1 holds the same token ids behind different chunk 0s: their
    chunk 1 files hold equal token ids under different keys. Swapped, each is a miss (the
    file names the key it was written under), so the rest is recomputed: same output."""
    prompt = _prompts()[0]
    other = _prompts()[1][:CHUNK_TOKENS] + prompt[CHUNK_TOKENS:]
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        _run(engine, [prompt, other])  # both fit the pool: the shutdown saves both
        assert engine.scheduler.disk is not None
        folder = engine.scheduler.disk.store.folder
    key = chunk_keys(np.asarray(prompt), CHUNK_TOKENS, None)[1]
    other_key = chunk_keys(np.asarray(other), CHUNK_TOKENS, None)[1]
    path, other_path = chunk_path(folder, key), chunk_path(folder, other_key)
    path.rename(tmp_path / "swap")
    other_path.rename(path)
    (tmp_path / "swap").rename(other_path)
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        ((ids, cached),) = _run(engine, [prompt])
        info = _info(engine)
        engine.check_invariants()
        assert not path.exists()  # deleted (until shutdown saves the chunk again)
    assert ids == reference[0]
    assert cached == CHUNK_TOKENS  # chunk 0 from disk, the rest recomputed
    assert info["kv_disk_loads"] == 1


def _release_fifo_readers(fifo: Path, done: Callable[[], bool]) -> None:
    """Open ``fifo`` for writing, and close it, until ``done()`` (30 s at most): each reader
    blocked opening it (a read-ahead, then a load) goes on, so a test that found a hang fails
    instead of hanging."""
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader is waiting right now
        time.sleep(0.05)


def test_a_fifo_in_the_tier_is_a_miss_not_a_hang(
    tiny_model_path: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """A FIFO named like a chunk the tier holds: the load opens nothing that can block, so the
    request completes (within a bound), with the chunks before it from disk."""
    prompt = _prompts()[0]
    through = {**POOL, **TIER, "kv_disk_write_policy": "write_through"}
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **through) as engine:
        _run(engine, [prompt])
        disk = engine.scheduler.disk
        assert disk is not None
        disk.store.flush(timeout=30)  # every chunk of the prompt written
        assert engine.flush_cache()  # memory only: the next request loads from disk
        path = chunk_path(disk.store.folder, chunk_keys(np.asarray(prompt), CHUNK_TOKENS, None)[2])
        path.unlink()
        os.mkfifo(path)
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(_run, engine, [prompt])
            try:
                ((ids, cached),) = request.result(timeout=60)
            except TimeoutError:
                _release_fifo_readers(path, request.done)
                pytest.fail("the request hung on a FIFO in the KV disk tier")
        engine.check_invariants()
        assert not os.path.lexists(path)
    assert ids == reference[0]
    assert cached == 2 * CHUNK_TOKENS


def test_write_through_writes_on_insert(tiny_model_path: Path, tmp_path: Path) -> None:
    (prompt,) = random_prompts([300], seed=7)
    through = {**POOL, **TIER, "kv_disk_write_policy": "write_through"}
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **through) as engine:
        _run(engine, [prompt])
        deadline = time.monotonic() + 30
        whole_chunks = 303 // CHUNK_TOKENS  # of the 303 cached tokens
        while _info(engine)["kv_disk_writes"] < whole_chunks and time.monotonic() < deadline:
            time.sleep(0.05)  # the writer thread writes behind the scheduler
        info = _info(engine)
        assert info["kv_disk_writes"] == whole_chunks
        assert engine.scheduler.kv.tree is not None
        assert engine.scheduler.kv.tree.stats().evicted_tokens == 0  # nothing was evicted


def test_tenants_never_load_each_others_chunks(tier_engine: Engine) -> None:
    prompts = _prompts()
    _run(tier_engine, prompts, salt="tenant-a")
    _run(tier_engine, prompts[2:], salt="tenant-a")  # push tenant-a's first prompts to disk
    before = _info(tier_engine)["kv_disk_loads"]
    other = _run(tier_engine, prompts[:2], salt="tenant-b")
    assert all(cached == 0 for _, cached in other)
    assert _info(tier_engine)["kv_disk_loads"] == before
    same = _run(tier_engine, prompts[:2], salt="tenant-a")
    assert all(cached >= 384 for _, cached in same)
    assert _info(tier_engine)["kv_disk_loads"] > before


def test_flush_cache_with_disk_empties_the_tier(tier_engine: Engine) -> None:
    prompts = _prompts()
    _run(tier_engine, prompts)
    assert tier_engine.flush_cache()
    after_memory_flush = _run(tier_engine, prompts[:1])
    assert after_memory_flush[0][1] >= 384  # memory gone, disk still serves
    assert tier_engine.flush_cache(disk=True)
    assert _run(tier_engine, prompts[1:2])[0][1] == 0


def test_write_error_keeps_serving(
    tiny_model_path: Path,
    tmp_path: Path,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def disk_full(path: Path, pieces: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk_store, "_write_file", disk_full)
    with Engine(tiny_model_path, kv_disk_path=str(tmp_path), **POOL, **TIER) as engine:
        prompts = _prompts()
        assert [ids for ids, _ in _run(engine, prompts + prompts)] == reference + reference
        info = _info(engine)
        engine.check_invariants()
    assert info["kv_disk_write_errors"] >= 1 and info["kv_disk_writes"] == 0


def test_a_folder_in_use_is_refused(tier_engine: Engine, tiny_model_path: Path) -> None:
    path = tier_engine.get_server_info()["kv_disk_path"]
    with pytest.raises(KVDiskError, match="replica0"):
        Engine(tiny_model_path, kv_disk_path=path, **POOL)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_disk_path": "{tmp}", "disable_radix_cache": True}, "needs the radix cache"),
        ({"kv_disk_path": "{tmp}", "kv_disk_max_gb": 0.0}, "kv_disk_max_gb"),
        ({"kv_disk_path": "{tmp}", "kv_disk_max_gb": -1.0}, "kv_disk_max_gb"),
        ({"kv_disk_path": "{tmp}/file"}, "not a folder"),
        ({"kv_disk_path": "{tmp}/file/kv"}, "not writable"),
        ({"kv_disk_path": "{tmp}", "kv_disk_write_policy": "sometimes"}, "write_back"),
    ],
)
def test_bad_flags_are_refused(
    tiny_model_path: Path, tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    (tmp_path / "file").write_text("")
    kwargs = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=str(tiny_model_path), **kwargs)


# ---- pieces, without an engine ------------------------------------------------------------


def test_model_identity_follows_config_and_weight_headers(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    same = model_identity(tiny_model_path)
    assert model_identity(tiny_model_path) == same
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_path, copy)
    assert model_identity(copy) == same  # where it lies does not matter
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 2
    (copy / "config.json").write_text(json.dumps(config))
    assert model_identity(copy) != same


def test_each_replica_and_chunk_size_has_its_own_folder_and_manifest(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    args = ServerArgs(model_path=str(tiny_model_path), kv_disk_path=str(tmp_path), page_size=128)
    args = args.for_device(False)
    pool = KVPool(256, 2, 2, 8, torch.float32, torch.device("cpu"))
    tier = open_disk_tier(args, pool, "none", "cpu", replica=3)
    try:
        assert tier.chunk_tokens == 128  # CHUNK_TOKENS rounded up to whole pages
        manifest = json.loads((tmp_path / "replica3" / "manifest.json").read_text())
        wanted = json.loads(json.dumps(disk_manifest(args, "none", 128)))
        assert wanted.items() <= manifest.items()  # the store adds its own file format
        assert manifest["kv_cache_dtype"] == "fp32" and manifest["page_size"] == 128
    finally:
        tier.close()


def test_load_cost_loads_only_what_beats_recomputing() -> None:
    cost = LoadCost("cpu")
    per_token = 46 * 1024  # SmolLM2's float32 K/V
    assert cost.pays(64, 64 * per_token)  # the priors: 200 MB/s against 1 ms a token
    for _ in range(50):  # a disk at 10 MB/s, a prefill at 0.5 ms a token
        cost.observe_load(1.0, 10_000_000)
        cost.observe_prefill(0.5, 1000)
    assert not cost.pays(64, 64 * per_token)
    for _ in range(50):  # the page cache: 2 GB/s
        cost.observe_load(0.5, 1_000_000_000)
    assert cost.pays(64, 64 * per_token)
    cost.observe_prefill(0.0, 8)  # a tiny forward tells nothing per token
    assert cost.recompute_s_per_token == pytest.approx(5e-4, rel=1e-3)

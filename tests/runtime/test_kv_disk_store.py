"""The KV disk tier's store: chunk keys, the chunk file, its checks, LRU, manifest, lock and
writer thread. Every failure of a file is a miss, never wrong K/V."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from runtime.kv_disk import KVDiskError, KVDiskStore, chunk_keys
from runtime.kv_disk import store as store_module
from runtime.kv_disk.staging import StagingArena

REPO = Path(__file__).resolve().parents[2]
MANIFEST = {"model": "abc123", "dtype": "float32", "kv_dtype": "fp32", "page_size": 16}
CHUNK = 16


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def _payload(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # [layers, k/v, tokens, heads, head_dim], a chunk's K/V as the tier would store it
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, CHUNK, 3, 8, generator=generator).to(dtype)


def _store(
    path: Path, max_bytes: int = 1 << 30, manifest: dict[str, Any] = MANIFEST, **kwargs: Any
) -> KVDiskStore:
    return KVDiskStore(path, max_bytes, manifest, **kwargs)


def _chunk_file(store: KVDiskStore, key: str) -> Path:
    return store.folder / key[:2] / f"{key}.kv"


def _get(store: KVDiskStore, key: str, tokens: np.ndarray) -> torch.Tensor | None:
    return store.get(key, tokens)


def _get_into(store: KVDiskStore, key: str, tokens: np.ndarray) -> torch.Tensor | None:
    out = torch.empty_like(_payload())
    return out if store.get_into(key, tokens, out) else None


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVDiskStore]:
    kv_store = _store(tmp_path)
    yield kv_store
    kv_store.close()


# -- keys ------------------------------------------------------------------------------------


def test_chunk_keys_name_the_whole_prefix_and_namespace() -> None:
    tokens = _tokens(5 * CHUNK + 7)
    keys = chunk_keys(tokens, CHUNK, None)
    assert len(keys) == 5  # the partial chunk gets no key
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in keys)
    assert len(set(keys)) == 5
    assert chunk_keys(tokens[: 3 * CHUNK], CHUNK, None) == keys[:3]  # same prefix, same keys
    assert chunk_keys(tokens.astype(np.int32), CHUNK, None) == keys  # dtype does not matter

    changed = tokens.copy()
    changed[3] += 1  # a token of chunk 0 changes every later key: a key names its prefix
    assert all(a != b for a, b in zip(chunk_keys(changed, CHUNK, None), keys, strict=True))
    changed = tokens.copy()
    changed[2 * CHUNK] += 1
    assert chunk_keys(changed, CHUNK, None)[:2] == keys[:2]
    assert chunk_keys(changed, CHUNK, None)[2] != keys[2]

    # Keys known for a prefix are reused and the chain goes on from the last one.
    assert chunk_keys(tokens, CHUNK, None, known=keys[:2]) == keys
    assert chunk_keys(tokens[: 2 * CHUNK], CHUNK, None, known=keys) == keys[:2]
    assert chunk_keys(tokens, CHUNK, None, known=["0" * 64])[1:] != keys[1:]  # it trusts them
    namespaces = [None, "", "a", "b", "ab", "\x00", "None"]
    firsts = {chunk_keys(tokens, CHUNK, ns)[0] for ns in namespaces}
    assert len(firsts) == len(namespaces)  # tenants never share a chunk
    assert chunk_keys(tokens, CHUNK, "a") == chunk_keys(tokens, CHUNK, "a")
    assert chunk_keys(tokens[: CHUNK - 1], CHUNK, None) == []
    with pytest.raises(ValueError):
        chunk_keys(tokens, 0, None)


# -- round trip and bad files -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_chunk_round_trips_with_its_dtype_and_shape(store: KVDiskStore, dtype: torch.dtype):
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    payload = _payload(1, dtype)
    assert not store.contains(key)
    assert store.get(key, tokens) is None
    store.put(key, tokens, payload)
    assert store.contains(key)
    loaded = store.get(key, tokens)
    assert loaded is not None
    assert loaded.dtype == dtype and loaded.shape == payload.shape
    assert torch.equal(loaded, payload)
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["writes"], stats["chunks"]) == (1, 1, 1, 1)
    assert stats["used_bytes"] == _chunk_file(store, key).stat().st_size > payload.nbytes
    assert stats["load_bytes"] == stats["used_bytes"] and stats["load_seconds"] > 0


@pytest.mark.parametrize("n_tokens", [CHUNK, 700])  # 700 int64 ids: a head over 4 KiB
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_get_into_reads_into_a_reused_buffer(store: KVDiskStore, n_tokens: int, dtype) -> None:
    tokens = _tokens(2 * n_tokens) + np.int64(1 << 40)  # ids beyond int32 are kept exactly
    keys = chunk_keys(tokens, n_tokens, None)
    payloads = [torch.randn(3, n_tokens, 5).to(dtype) for _ in keys]
    for i, key in enumerate(keys):
        store.put(key, tokens[i * n_tokens : (i + 1) * n_tokens], payloads[i])
    staging = torch.empty(3 * n_tokens * 5, dtype=dtype)  # another shape, same elements
    for i, key in enumerate(keys):
        assert store.get_into(key, tokens[i * n_tokens : (i + 1) * n_tokens], staging)
        assert torch.equal(staging.view(payloads[i].shape), payloads[i])
    # a caller's mistake (another size, dtype or token count) is a miss that keeps the file
    assert not store.get_into(keys[0], tokens[:n_tokens], torch.empty(7, dtype=dtype))
    assert not store.get_into(keys[0], tokens[:n_tokens], staging.to(torch.float16))
    assert store.get(keys[0], tokens[: n_tokens - 1]) is None
    assert store.get(keys[0], tokens[:n_tokens]) is not None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["bad_files"]) == (3, 3, 0)
    with pytest.raises(ValueError, match="contiguous"):
        store.get_into(keys[1], tokens[n_tokens:], staging.view(3, -1).t())


def test_a_strided_payload_is_stored_in_c_order(store: KVDiskStore) -> None:
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    payload = _payload(3, torch.float16).transpose(0, 2)
    store.put(key, tokens, payload)
    loaded = store.get(key, tokens)
    assert loaded is not None and loaded.shape == payload.shape and torch.equal(loaded, payload)


def test_a_linked_chunk_file_is_not_followed(store: KVDiskStore, tmp_path: Path) -> None:
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    store.put(key, tokens, _payload())
    outside = tmp_path / "outside.kv"
    _chunk_file(store, key).rename(outside)
    _chunk_file(store, key).symlink_to(outside)
    assert store.get(key, tokens) is None
    assert outside.exists() and not _chunk_file(store, key).is_symlink()


def _in_thread(call: Any, fifo: Path, seconds: float = 20.0) -> Any:
    """``call()``'s result, run on a thread that must end within ``seconds``. If it blocks
    (a reader waiting on ``fifo`` for a writer) the FIFO is opened for writing and closed, so
    the reader sees its end and the test fails instead of hanging."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(seconds)
        pytest.fail(f"reading the tier blocked on the FIFO {fifo}")
    return result[0]


@pytest.mark.parametrize("load", ["get", "get_into", "read_ahead"])
def test_a_fifo_named_like_a_chunk_is_a_miss_at_once(store: KVDiskStore, load: str) -> None:
    """A FIFO is never opened for a blocking read: the load is a miss at once, and the name is
    removed (unlink: nothing is opened), so the scheduler is never stuck on the tier."""
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    store.put(key, tokens, _payload())
    path = _chunk_file(store, key)
    path.unlink()
    os.mkfifo(path)
    calls = {
        "get": lambda: store.get(key, tokens),
        "get_into": lambda: _get_into(store, key, tokens),
        "read_ahead": lambda: store.read_ahead([key]),
    }
    assert _in_thread(calls[load], path) in (None, 0)
    if load == "read_ahead":  # a hint skips it and checks nothing: the load judges it
        assert _in_thread(calls["get"], path) is None
    assert not os.path.lexists(path) and not store.contains(key)
    assert store.stats()["bad_files"] == 1
    store.put(key, tokens, _payload())  # the chunk can be stored again
    loaded = store.get(key, tokens)
    assert loaded is not None and torch.equal(loaded, _payload())


def test_a_restart_removes_what_is_named_like_a_chunk_but_is_no_file(tmp_path: Path) -> None:
    tokens = _tokens(4 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    store = _store(tmp_path)
    store.put(keys[0], tokens[:CHUNK], _payload())
    store.close()
    folder = store.folder
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.kv").write_bytes(b"not the tier's")
    fifo, link, stray = (_chunk_file(store, k) for k in keys[1:])
    for path in (fifo, link, stray):
        path.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    link.symlink_to(outside / "keep.kv")
    stray.mkdir()
    (stray / "inside").symlink_to(outside)  # removed as a name, never followed

    store = _store(tmp_path)
    assert [store.contains(k) for k in keys] == [True, False, False, False]
    assert not any(os.path.lexists(p) for p in (fifo, link, stray))
    assert (outside / "keep.kv").read_bytes() == b"not the tier's"
    store.close()
    assert folder.exists()


@pytest.mark.parametrize("load", [_get, _get_into])
@pytest.mark.parametrize("move", ["swap", "copy"])
def test_a_chunk_file_under_another_key_is_a_miss_and_deleted(
    store: KVDiskStore, load, move: str
) -> None:
    """Two prefixes whose chunk 1 holds the same 16 token ids have different keys (the chain
    differs): a file moved from one key to the other holds the right token ids and checksum,
    but it was written under the other key, so the load is a miss and the file deleted."""
    shared = _tokens(CHUNK, seed=9)
    first = np.concatenate([_tokens(CHUNK, seed=1), shared])
    second = np.concatenate([_tokens(CHUNK, seed=2), shared])
    key_a, key_b = chunk_keys(first, CHUNK, None)[1], chunk_keys(second, CHUNK, None)[1]
    assert key_a != key_b
    store.put(key_a, shared, _payload(1))
    store.put(key_b, shared, _payload(2))
    path_a, path_b = _chunk_file(store, key_a), _chunk_file(store, key_b)
    if move == "swap":
        path_a.rename(path_a.with_name("swap"))
        path_b.rename(path_a)
        path_a.with_name("swap").rename(path_b)
    else:
        path_a.write_bytes(path_b.read_bytes())
    assert load(store, key_a, shared) is None
    assert not path_a.exists() and not store.contains(key_a)
    assert store.stats()["bad_files"] == 1
    if move == "copy":  # the file under its own key still loads
        loaded = load(store, key_b, shared)
        assert loaded is not None and torch.equal(loaded, _payload(2))


def test_a_linked_fan_out_folder_is_never_followed(tmp_path: Path) -> None:
    """A fan-out folder replaced by a link to elsewhere: nothing is written, read, or deleted
    there, at start, on writes, loads, evictions, clears, or a manifest reset."""
    tokens = _tokens(3 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "tier" / "replica0"
    folder.mkdir(parents=True)

    def plant() -> dict[str, bytes]:
        """Link the fan-out folder of keys[0] to ``outside``, holding files the tier would
        touch were it followed; what ``outside`` holds."""
        fan_out = folder / keys[0][:2]
        if fan_out.is_symlink() or fan_out.is_file():
            fan_out.unlink()
        elif fan_out.exists():
            shutil.rmtree(fan_out)
        fan_out.symlink_to(outside, target_is_directory=True)
        (outside / f"{keys[0]}.kv").write_bytes(b"someone else's")
        (outside / "half.tmp").write_bytes(b"someone else's")
        return {p.name: p.read_bytes() for p in outside.iterdir()}

    planted = plant()
    store = _store(tmp_path / "tier")  # the start's scan
    assert not store.contains(keys[0])
    store.put(keys[0], chunks[0], _payload(0))  # a write replaces the link by a folder
    assert not (folder / keys[0][:2]).is_symlink() and store.contains(keys[0])
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == planted

    planted = plant()  # behind the store's back, after the write
    assert store.get(keys[0], chunks[0]) is None  # not read through the link
    store.put(keys[0], chunks[0], _payload(0))
    planted = plant()
    store.clear()
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == planted
    store.put(keys[0], chunks[0], _payload(0))
    planted = plant()
    probe = _store(tmp_path / "probe")
    probe.put(keys[1], chunks[1], _payload(1))
    size = probe.stats()["used_bytes"]
    probe.close()
    store.max_bytes = size
    store.put(keys[1], chunks[1], _payload(1))  # evicts keys[0]
    store.put(keys[2], chunks[2], _payload(2))
    store.close()
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == planted
    planted = plant()
    store = _store(tmp_path / "tier", manifest={**MANIFEST, "model": "other"})  # a reset
    store.close()
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == planted


def test_a_stray_folder_named_like_a_chunk_goes_at_a_reset_and_blocks_no_write(
    tmp_path: Path,
) -> None:
    tokens = _tokens(2 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    store = _store(tmp_path / "tier")

    def stray(key: str) -> Path:
        path = _chunk_file(store, key)
        path.mkdir(parents=True)
        (path / "inside.kv").write_bytes(b"y")
        (path / "link").symlink_to(outside, target_is_directory=True)
        return path

    path = stray(keys[0])
    store.clear()  # flush_cache?disk=true
    assert not os.path.lexists(path) and (outside / "keep").exists()
    path = stray(keys[0])
    store.put(keys[0], tokens[:CHUNK], _payload())  # the chunk takes the folder's place
    assert path.is_file() and not store.writes_paused and store.stats()["write_errors"] == 0
    path = stray(keys[1])
    store.close()
    store = _store(tmp_path / "tier", manifest={**MANIFEST, "model": "other"})  # a reset
    assert not os.path.lexists(path) and (outside / "keep").exists()
    store.close()


def test_links_at_the_lock_and_manifest_names_are_not_written_through(tmp_path: Path) -> None:
    folder = tmp_path / "replica0"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (folder / "manifest.json.tmp").symlink_to(victim)
    _store(tmp_path).close()  # a new manifest is written
    assert victim.read_text() == "keep me"
    assert json.loads((folder / "manifest.json").read_text())["model"] == MANIFEST["model"]
    (folder / "lock").unlink()
    (folder / "lock").symlink_to(victim)
    with pytest.raises(KVDiskError, match="lock file"):
        _store(tmp_path)
    assert victim.read_text() == "keep me"


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _bad_magic(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0:4] = b"XXXX"
    path.write_bytes(bytes(data))


def _append(path: Path) -> None:
    with open(path, "ab") as file:
        file.write(b"\0")


@pytest.mark.parametrize("load", [_get, _get_into])
@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _truncate, _bad_magic, _append])
def test_a_damaged_file_is_a_miss_and_deleted(store: KVDiskStore, damage, load) -> None:
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    store.put(key, tokens, _payload())
    damage(_chunk_file(store, key))
    assert load(store, key, tokens) is None
    assert not _chunk_file(store, key).exists()
    assert not store.contains(key)
    stats = store.stats()
    assert (stats["bad_files"], stats["hits"], stats["chunks"], stats["used_bytes"]) == (1, 0, 0, 0)


@pytest.mark.parametrize("load", [_get, _get_into])
def test_other_token_ids_under_a_key_are_a_miss(store: KVDiskStore, load) -> None:
    """A key collision: the file's own token ids are compared, so it never returns other K/V."""
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    store.put(key, tokens, _payload())
    other = tokens.copy()
    other[-1] += 1
    assert load(store, key, other) is None
    assert not _chunk_file(store, key).exists() and not store.contains(key)


def test_a_deleted_file_is_a_miss(store: KVDiskStore) -> None:
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    store.put(key, tokens, _payload())
    _chunk_file(store, key).unlink()
    assert store.get(key, tokens) is None
    assert not store.contains(key) and store.stats()["used_bytes"] == 0


def test_read_ahead_hints_stored_chunks_only_and_a_later_change_is_a_miss(
    store: KVDiskStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = _tokens(3 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    for i in (0, 2):
        store.put(keys[i], tokens[i * CHUNK : (i + 1) * CHUNK], _payload(i))
    hinted: list[tuple[str, int]] = []
    fadvise = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        hinted.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    assert store.read_ahead(keys) == 2  # chunk 1 is not stored
    assert hinted == [(str(_chunk_file(store, keys[i])), os.POSIX_FADV_WILLNEED) for i in (0, 2)]
    _chunk_file(store, keys[2]).unlink()
    assert store.read_ahead(keys) == 1  # a file gone behind the store's back is skipped
    # The hint holds nothing: a file damaged after it is a miss when read, and deleted.
    path = _chunk_file(store, keys[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(keys[0], tokens[:CHUNK]) is None
    assert not path.exists() and not store.contains(keys[0])


@pytest.mark.parametrize(
    "key", ["../../etc/passwd", "ab", "A" * 64, "g" * 64, "a" * 63 + "/", "a" * 65, 7, None]
)
def test_only_hex_keys_of_the_right_length_reach_a_path(store: KVDiskStore, key) -> None:
    tokens = _tokens(CHUNK)
    for call in (
        lambda: store.get(key, tokens),
        lambda: store.put(key, tokens, _payload()),
        lambda: store.put_async(key, tokens, _payload()),
        lambda: store.contains(key),
        lambda: store.read_ahead([key]),
    ):
        with pytest.raises(ValueError, match="chunk key"):
            call()


# -- space ---------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_within_max_bytes(tmp_path: Path) -> None:
    tokens = _tokens(4 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(4)]
    with_one = _store(tmp_path / "probe")
    with_one.put(keys[0], chunks[0], _payload())
    size = with_one.stats()["used_bytes"]
    with_one.close()

    store = _store(tmp_path, max_bytes=3 * size + size // 2)
    for i in range(3):
        store.put(keys[i], chunks[i], _payload(i))
    assert store.get(keys[0], chunks[0]) is not None  # 0 is now the most recently used
    store.put(keys[3], chunks[3], _payload(3))
    assert [store.contains(k) for k in keys] == [True, False, True, True]
    stats = store.stats()
    assert stats["used_bytes"] == 3 * size <= store.max_bytes and stats["evictions"] == 1
    assert not _chunk_file(store, keys[1]).exists()
    store.close()


def test_a_restart_orders_the_lru_by_file_mtime(tmp_path: Path) -> None:
    tokens = _tokens(4 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(4)]
    store = _store(tmp_path)
    for i in range(3):
        store.put(keys[i], chunks[i], _payload(i))
    size = store.stats()["used_bytes"] // 3
    store.close()
    for age, i in enumerate([1, 0, 2]):  # last used: 1 (newest), then 0, then 2 (oldest)
        os.utime(_chunk_file(store, keys[i]), ns=(10**18 - age * 10**9,) * 2)
    # reopened smaller than what it holds: the oldest by mtime goes at once
    store = _store(tmp_path, max_bytes=2 * size + 1)
    assert [store.contains(k) for k in keys[:3]] == [True, True, False]
    store.put(keys[3], chunks[3], _payload(3))
    assert [store.contains(k) for k in keys] == [False, True, False, True]
    store.close()


def test_a_stored_key_is_not_written_again_but_made_recent(tmp_path: Path) -> None:
    tokens = _tokens(3 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    store = _store(tmp_path)
    store.put(keys[0], chunks[0], _payload(0))
    size = store.stats()["used_bytes"]
    store.close()
    store = _store(tmp_path, max_bytes=2 * size + 1)
    store.put(keys[1], chunks[1], _payload(1))
    inode = _chunk_file(store, keys[0]).stat().st_ino
    assert store.put_async(keys[0], chunks[0], _payload(0))  # stored: made the newest
    store.put(keys[0], chunks[0], _payload(0))
    store.flush(timeout=30)
    assert store.stats()["writes"] == 1 and _chunk_file(store, keys[0]).stat().st_ino == inode
    store.put(keys[2], chunks[2], _payload(2))
    assert [store.contains(k) for k in keys] == [True, False, True]
    store.close()


def test_a_chunk_larger_than_the_tier_is_not_stored(tmp_path: Path) -> None:
    store = _store(tmp_path, max_bytes=1000)
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    store.put(key, tokens, _payload())
    assert not store.contains(key) and store.stats()["dropped_writes"] == 1
    store.close()


# -- restart, manifest, lock ------------------------------------------------------------


def test_a_restart_keeps_the_chunks_and_drops_torn_writes(tmp_path: Path) -> None:
    tokens = _tokens(2 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, "tenant")
    store = _store(tmp_path)
    store.put(keys[0], tokens[:CHUNK], _payload(0, torch.bfloat16))
    store.put(keys[1], tokens[CHUNK:], _payload(1, torch.float16))
    store.close()
    leftover = _chunk_file(store, keys[0]).with_name("leftover.tmp")
    leftover.write_bytes(b"half a chunk")

    store = _store(tmp_path)
    assert store.stats()["chunks"] == 2 and not leftover.exists()
    loaded = store.get(keys[1], tokens[CHUNK:])
    assert loaded is not None and torch.equal(loaded, _payload(1, torch.float16))
    store.close()


def test_a_manifest_mismatch_empties_the_tier_with_one_warning(tmp_path: Path, caplog) -> None:
    tokens = _tokens(CHUNK)
    key = chunk_keys(tokens, CHUNK, None)[0]
    caplog.set_level(logging.WARNING, logger="runtime.kv_disk")
    store = _store(tmp_path)  # a fresh folder: nothing to warn about
    store.put(key, tokens, _payload())
    store.close()
    store = _store(tmp_path)  # the same manifest keeps the chunk
    assert store.contains(key)
    store.close()
    assert caplog.records == []

    store = _store(tmp_path, manifest={**MANIFEST, "page_size": 32})
    assert not store.contains(key) and not _chunk_file(store, key).exists()
    assert len(caplog.records) == 1
    assert "page_size: 16 -> 32" in caplog.records[0].getMessage()
    assert str(store.folder) in caplog.records[0].getMessage()
    store.close()
    store = _store(tmp_path, manifest={**MANIFEST, "page_size": 32})  # now the stored one
    store.close()
    assert len(caplog.records) == 1


def test_a_second_store_on_a_folder_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with pytest.raises(KVDiskError, match="replica0.*in use"):
        _store(tmp_path)
    other = _store(tmp_path, subfolder="replica1")  # each --dp replica has its own subfolder
    other.close()
    store.close()
    store.close()  # idempotent
    _store(tmp_path).close()  # released


def test_a_folder_another_process_holds_is_refused_until_it_dies(tmp_path: Path) -> None:
    """Another server's process holds the folder (through the lock KVDiskStore takes; the
    child skips importing torch). When it dies, even by SIGKILL, the folder is free again."""
    folder = tmp_path / "replica0"
    folder.mkdir()
    code = (
        "import sys; from pathlib import Path\n"
        "from runtime.kv_disk.folder import take_folder_lock\n"
        "take_folder_lock(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "locked\n"
        with pytest.raises(KVDiskError, match=f"{re.escape(str(folder))}.*process {child.pid}"):
            _store(tmp_path)
    finally:
        child.kill()
        child.wait(30)
    _store(tmp_path).close()


def test_bad_sizes_and_folders_stop_start_up(tmp_path: Path) -> None:
    for size in (0, -1, 1.5):
        with pytest.raises(KVDiskError, match="positive"):
            _store(tmp_path, max_bytes=size)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(KVDiskError, match="cannot create"):
        _store(a_file / "tier")
    for subfolder in ("..", "../x", "a/b", ""):
        with pytest.raises(KVDiskError, match="subfolder"):
            _store(tmp_path, subfolder=subfolder)


# -- the writer thread -------------------------------------------------------------------


def test_put_async_writes_on_the_thread_and_flush_waits(store: KVDiskStore) -> None:
    tokens = _tokens(8 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    for i, key in enumerate(keys):
        assert store.put_async(key, tokens[i * CHUNK : (i + 1) * CHUNK], _payload(i))
    store.flush(timeout=30)
    assert store.stats()["queued_bytes"] == 0
    for i, key in enumerate(keys):
        loaded = store.get(key, tokens[i * CHUNK : (i + 1) * CHUNK])
        assert loaded is not None and torch.equal(loaded, _payload(i))


def test_the_write_queue_is_bounded_by_bytes(tmp_path: Path, monkeypatch) -> None:
    release = threading.Event()
    real_write = store_module._write_file

    def slow_write(directory: int, name: str, pieces: list) -> int:
        release.wait(30)
        return real_write(directory, name, pieces)

    monkeypatch.setattr(store_module, "_write_file", slow_write)
    payload = _payload()
    store = _store(tmp_path, write_queue_bytes=2 * payload.nbytes)
    tokens = _tokens(3 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    assert store.put_async(keys[0], chunks[0], payload)
    assert store.put_async(keys[1], chunks[1], payload)
    assert not store.put_async(keys[2], chunks[2], payload)  # over the bound: dropped
    assert store.stats()["dropped_writes"] == 1
    release.set()
    store.flush(timeout=30)
    assert [store.contains(k) for k in keys] == [True, True, False]
    store.close()


def test_put_async_releases_each_payload_once_after_the_store_is_done_with_it(
    tmp_path: Path, monkeypatch
) -> None:
    # A payload in reused memory (the tier's staging arena) may be overwritten only after its
    # release: never while it is queued or being written, and released however it ends.
    writing = threading.Event()
    go_on = threading.Event()
    real_write = store_module._write_file

    def held_write(directory: int, name: str, pieces: list) -> int:
        writing.set()
        go_on.wait(30)
        return real_write(directory, name, pieces)

    monkeypatch.setattr(store_module, "_write_file", held_write)
    payload = _payload()
    store = _store(tmp_path, write_queue_bytes=3 * payload.nbytes)  # the one written counts
    tokens = _tokens(4 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(4)]
    released: list[int] = []
    assert store.put_async(keys[0], chunks[0], _payload(0), lambda: released.append(0))
    assert writing.wait(30)
    assert store.put_async(keys[1], chunks[1], _payload(1), lambda: released.append(1))
    assert store.put_async(keys[2], chunks[2], _payload(2), lambda: released.append(2))
    assert released == []  # being written, and queued: neither is released
    assert not store.put_async(keys[3], chunks[3], _payload(3), lambda: released.append(3))
    assert released == [3]  # dropped (the queue is full): released before put_async returns
    go_on.set()
    store.flush(timeout=30)
    assert sorted(released) == [0, 1, 2, 3]
    for i in range(3):
        loaded = store.get(keys[i], chunks[i])
        assert loaded is not None and torch.equal(loaded, _payload(i))
    assert store.put_async(keys[0], chunks[0], _payload(0), lambda: released.append(4))
    assert released[-1] == 4  # already stored: nothing queued, released at once
    store.close()
    assert len(released) == 5


def test_the_staging_arena_hands_out_free_entries_only() -> None:
    arena = StagingArena((2, 3), torch.float32, capacity=3)
    first = arena.take(2)
    assert first is not None and len(set(first)) == 2
    assert arena.take(2) is None and arena.available() == 1  # too few: nothing taken
    second = arena.take(1)
    assert second is not None and set(second).isdisjoint(first)
    arena.give_back(first[1])
    assert arena.take(1) == [first[1]]
    assert arena.buffer.shape == (3, 2, 3)
    with pytest.raises(ValueError, match="positive capacity"):
        StagingArena((2, 3), torch.float32, capacity=0)


def test_a_write_error_pauses_writes_with_a_growing_capped_backoff(
    store: KVDiskStore, monkeypatch, caplog
) -> None:
    tokens = _tokens(6 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(6)]
    store.put(keys[0], chunks[0], _payload(0))
    real_write = store_module._write_file
    now = [1000.0]  # the store's clock, moved by hand
    clock = SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(store_module, "time", clock)

    def broken(directory: int, name: str, pieces: list) -> int:
        raise RuntimeError("a defect, not a disk error")

    monkeypatch.setattr(store_module, "_write_file", broken)
    caplog.set_level(logging.WARNING, logger="runtime.kv_disk")
    assert store.put_async(keys[1], chunks[1], _payload(1))
    store.flush(timeout=30)
    assert store.stats()["write_errors"] == 1 and not store.writes_paused
    assert store._writer.is_alive()

    def full_disk(directory: int, name: str, pieces: list) -> int:
        real_write(directory, name, pieces[:1])  # a torn temporary file, which must not stay
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "_write_file", full_disk)
    caplog.clear()
    assert store.put_async(keys[2], chunks[2], _payload(2))
    store.flush(timeout=30)
    assert store.writes_paused and store.stats()["writes_paused"] == 1
    store.put(keys[3], chunks[3], _payload(3))  # paused: a put is dropped, not raised
    assert not store.put_async(keys[3], chunks[3], _payload(3))
    stats = store.stats()
    assert (stats["write_errors"], stats["dropped_writes"], stats["chunks"]) == (2, 2, 1)
    # Each failure in a row doubles the pause (1 s, 2 s, 4 s, ...) up to 300 s.
    pauses = []
    for _ in range(11):
        start = now[0]
        while store.writes_paused:
            now[0] += 0.5
        pauses.append(now[0] - start)
        store.put(keys[3], chunks[3], _payload(3))  # fails again
    assert pauses[:9] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
    assert pauses[9:] == [300.0, 300.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ENOSPC" in warnings[0].getMessage()  # one per streak
    assert list(store.folder.rglob("*.tmp")) == []
    loaded = store.get(keys[0], chunks[0])  # reads go on
    assert loaded is not None and torch.equal(loaded, _payload(0))

    # The disk has room again: after the pause, writes resume, and the streak starts over.
    monkeypatch.setattr(store_module, "_write_file", real_write)
    now[0] += 300.0
    assert store.put_async(keys[4], chunks[4], _payload(4))
    store.flush(timeout=30)
    assert store.contains(keys[4]) and not store.writes_paused
    monkeypatch.setattr(store_module, "_write_file", full_disk)
    start = now[0]
    store.put(keys[5], chunks[5], _payload(5))
    while store.writes_paused:
        now[0] += 0.5
    assert now[0] - start == 1.0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_clear_deletes_every_chunk_and_queued_writes(tmp_path: Path, monkeypatch) -> None:
    started, release = threading.Event(), threading.Event()
    real_write = store_module._write_file

    def held_write(directory: int, name: str, pieces: list) -> int:
        started.set()
        release.wait(30)
        return real_write(directory, name, pieces)

    store = _store(tmp_path)
    tokens = _tokens(3 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    store.put(keys[0], chunks[0], _payload())
    monkeypatch.setattr(store_module, "_write_file", held_write)
    assert store.put_async(keys[1], chunks[1], _payload())  # being written during clear
    assert store.put_async(keys[2], chunks[2], _payload())  # still queued
    assert started.wait(30)
    store.clear()
    release.set()
    store.flush(timeout=30)
    assert [store.contains(k) for k in keys] == [False, False, False]
    assert list(store.folder.rglob("*.kv")) == [] and store.stats()["used_bytes"] == 0
    store.close()
    assert not store.put_async(keys[0], chunks[0], _payload())  # closed
    assert store.get(keys[0], chunks[0]) is None


def test_concurrent_loads_writes_evictions_and_clears_never_give_wrong_kv(
    tmp_path: Path,
) -> None:
    tokens = _tokens(8 * CHUNK)
    keys = chunk_keys(tokens, CHUNK, None)
    chunks = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(8)]
    payloads = [_payload(i) for i in range(8)]
    probe = _store(tmp_path / "probe")
    probe.put(keys[0], chunks[0], payloads[0])
    size = probe.stats()["used_bytes"]
    probe.close()
    store = _store(tmp_path, max_bytes=3 * size)  # 3 of 8: constant eviction
    staging = torch.empty_like(payloads[0])
    stop = threading.Event()
    wrong: list[int] = []
    hits = [0]

    def read(use_staging: bool) -> None:
        rng = np.random.default_rng(int(use_staging))
        while not stop.is_set():
            i = int(rng.integers(8))
            if use_staging:
                loaded = staging if store.get_into(keys[i], chunks[i], staging) else None
            else:
                loaded = store.get(keys[i], chunks[i])
            if loaded is not None:
                hits[0] += 1
                if not torch.equal(loaded, payloads[i]):
                    wrong.append(i)

    readers = [threading.Thread(target=read, args=(flag,)) for flag in (False, True)]
    for reader in readers:
        reader.start()
    rng = np.random.default_rng(2)
    for step in range(300):
        i = int(rng.integers(8))
        if step % 3:
            store.put_async(keys[i], chunks[i], payloads[i])
        else:
            store.put(keys[i], chunks[i], payloads[i])
        if step % 97 == 96:
            store.clear()
    store.flush(timeout=30)
    stop.set()
    for reader in readers:
        reader.join(30)
    assert wrong == [] and hits[0] > 0
    stats = store.stats()
    files = list(store.folder.rglob("*.kv"))
    assert stats["chunks"] == len(files) and stats["used_bytes"] == sum(
        f.stat().st_size for f in files
    )
    assert stats["used_bytes"] <= store.max_bytes and stats["bad_files"] == 0
    store.close()

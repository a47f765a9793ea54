"""``KVDiskStore``: the chunk files of one folder, their LRU index and their writer thread.

One store owns ``path/subfolder`` for its life (its lock file, ``folder.py``), so its index is
the truth about the folder: ``contains`` asks no disk. Threads: any caller thread may call
every method; one daemon writer thread drains ``put_async``'s queue. Every write goes to a
temporary file that is renamed into place, so a reader sees a whole file or none. Nothing is
fsynced: a file torn by a crash or a full disk fails its checksum on load, so a lost chunk is
only a miss, and fsync would cost each write a flush to the device. Files are reached through
``folder.py``, which follows no link inside the folder and reads regular files only.

A failed write (a full disk, a read-only remount) pauses writes, then they are tried again:
the pause starts at WRITE_RETRY_FIRST_S and doubles with each failure in a row, up to
WRITE_RETRY_MAX_S; a write that succeeds ends the streak.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from runtime.kv_disk.chunk_file import (
    FORMAT_VERSION,
    ChunkMismatch,
    RequestMismatch,
    check_payload,
    decode_chunk,
    decode_chunk_into,
    encode_chunk,
)
from runtime.kv_disk.folder import (
    TMP_SUFFIX,
    KVDiskError,
    check_manifest,
    chunk_path,
    chunk_stat,
    delete_chunk_files,
    install_chunk,
    open_chunk,
    open_fan_out,
    release_folder_lock,
    remove_chunk,
    scan_chunks,
    take_folder_lock,
    touch_chunk,
    unlink_quietly,
)
from runtime.kv_disk.keys import chunk_keys, is_chunk_key

__all__ = ["KVDiskError", "KVDiskStore", "chunk_keys"]

logger = logging.getLogger(__name__)
_Loaded = TypeVar("_Loaded")
_SUBFOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_COUNTERS = (
    "hits",
    "misses",
    "load_bytes",
    "writes",
    "write_bytes",
    "write_errors",
    "dropped_writes",
    "evictions",
    "bad_files",
)


@dataclass(frozen=True)
class _QueuedWrite:
    key: str
    token_ids: np.ndarray
    payload: torch.Tensor
    nbytes: int
    generation: int  # clear() bumps the store's: a write queued before it is dropped
    release: Callable[[], None] | None  # called when the payload is no longer needed


class KVDiskStore:
    """Chunks of K/V on disk, at most ``max_bytes`` of them (least recently used go first).

    ``manifest`` (a JSON-able dict: what makes stored K/V valid, e.g. model identity, dtypes,
    page size, tp rank) is compared with the folder's ``manifest.json``: on a mismatch every
    chunk is deleted, with one warning naming what differs. Raises KVDiskError when the folder
    cannot be created or written, is held by another store, or a size is not positive.
    """

    # The pause after a failed write, doubled per failure in a row up to the cap (seconds).
    WRITE_RETRY_FIRST_S = 1.0
    WRITE_RETRY_MAX_S = 300.0

    def __init__(
        self,
        path: str | Path,
        max_bytes: int,
        manifest: dict[str, Any],
        *,
        subfolder: str = "replica0",
        write_queue_bytes: int = 256 << 20,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise KVDiskError(
                f"the KV disk tier's size must be a positive number of bytes, got {max_bytes!r}"
            )
        if write_queue_bytes <= 0:
            raise KVDiskError(f"write_queue_bytes must be positive, got {write_queue_bytes!r}")
        if _SUBFOLDER.fullmatch(subfolder) is None:
            raise KVDiskError(
                f"the KV disk subfolder must be a plain name of letters, digits, "
                f"'.', '_' and '-', got {subfolder!r}"
            )
        self.folder = Path(path) / subfolder
        self.max_bytes = max_bytes
        self._write_queue_bytes = write_queue_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KVDiskError(f"cannot create the KV disk folder {self.folder}: {e}") from e
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise KVDiskError(f"the KV disk folder {self.folder} is not writable")
        self._lock_fd = take_folder_lock(self.folder)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as queued writes finish
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, oldest first
        self._used_bytes = 0
        self._generation = 0
        self._queued_writes = 0
        self._queued_bytes = 0
        self._closing = False  # close() began: no new puts
        self._closed = False  # close() ended: the folder is no longer this store's
        self._write_failures = 0  # failed writes in a row
        self._writes_paused_until = 0.0  # time.monotonic() before which puts are dropped
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._load_seconds = 0.0
        try:
            # a new chunk format invalidates the old files like a new model does
            check_manifest(self.folder, {"kv_disk_format": FORMAT_VERSION, **manifest})
            for key, size in scan_chunks(self.folder):  # oldest first
                self._index[key] = size
                self._used_bytes += size
        except OSError as e:
            release_folder_lock(self._lock_fd)
            raise KVDiskError(f"cannot use the KV disk folder {self.folder}: {e}") from e
        except BaseException:
            release_folder_lock(self._lock_fd)
            raise
        self._evict_locked()  # max_bytes may be smaller than at the last run
        self._queue: queue.SimpleQueue[_QueuedWrite | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- reads ---------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether a chunk is stored under ``key`` (from the index; no disk access)."""
        _check_key(key)
        with self._lock:
            return key in self._index

    def get(self, key: str, token_ids: np.ndarray) -> torch.Tensor | None:
        """The payload stored under ``key`` (same dtype and shape as put) if its file holds
        exactly ``token_ids`` (the chunk's own tokens, as put) and its checksum holds; else
        None, and a bad file (damaged, or other token ids: a key collision) is deleted. Asking
        with another number of token ids is a miss that keeps the file and logs a warning.
        A hit makes the chunk the most recently used."""
        return self._load(key, lambda fd, size: decode_chunk(fd, size, key, token_ids))

    def get_into(self, key: str, token_ids: np.ndarray, out: torch.Tensor) -> bool:
        """``get`` that reads the payload's elements (C order) straight into ``out``: a
        contiguous CPU tensor of the stored dtype and element count, e.g. a staging buffer
        reused across loads, which saves faulting in fresh memory (an ``out`` of another dtype
        or size is a miss like ``get``'s wrong token count). True on a hit; on a miss (False)
        ``out`` holds garbage."""
        check_payload(out)
        if not out.is_contiguous():
            raise ValueError("get_into needs a contiguous tensor to read into")
        loaded = self._load(key, lambda fd, size: decode_chunk_into(fd, size, key, token_ids, out))
        return loaded is not None

    def read_ahead(self, keys: list[str]) -> int:
        """Ask the kernel to start reading the stored chunks of ``keys`` into the page cache
        (``posix_fadvise(WILLNEED)``: it returns at once, the disk works in the background), so
        a later ``get`` finds them there. Holds nothing and checks nothing: what the file holds
        when it is read is what ``get`` checks, so a file that changes after the hint is only a
        miss. Returns how many files were hinted (keys not stored, or files gone, are
        skipped)."""
        hinted = 0
        for key in keys:
            if not self.contains(key):
                continue
            try:
                fd, _ = open_chunk(self.folder, key)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                hinted += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return hinted

    def _load(self, key: str, decode: Callable[[int, int], _Loaded]) -> _Loaded | None:
        """``decode(fd, size)`` of the chunk file of ``key``, counted as a hit and made the
        most recently used; None on a miss, deleting a file ``decode`` rejects and whatever
        is at the chunk's name that is not a regular file (a link, a FIFO: never read)."""
        _check_key(key)
        with self._lock:
            if self._closing or key not in self._index:
                self._counters["misses"] += 1
                return None
        path = self._chunk_path(key)
        start = time.perf_counter()
        stat: os.stat_result | None = None
        try:
            fd, stat = open_chunk(self.folder, key)
            try:
                loaded = decode(fd, stat.st_size)
                _touch(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._forget_missing(key)
            return None
        except RequestMismatch as e:  # the file is kept: the load was wrong, not the file
            with self._lock:
                self._counters["misses"] += 1
            logger.warning("KV disk load of %s asked for something else: %s", path, e)
            return None
        except (ChunkMismatch, OSError) as e:
            logger.debug("KV disk chunk %s is unusable (%s); deleting it", path, e)
            self._delete_bad(key, stat)
            return None
        except Exception:  # a defect in decoding: still a miss, never wrong K/V
            logger.exception("KV disk chunk %s could not be decoded; deleting it", path)
            self._delete_bad(key, stat)
            return None
        elapsed = time.perf_counter() - start
        with self._lock:
            self._counters["hits"] += 1
            self._counters["load_bytes"] += stat.st_size
            self._load_seconds += elapsed
            if key in self._index:
                self._index.move_to_end(key)
        return loaded

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, token_ids: np.ndarray, payload: torch.Tensor) -> None:
        """Store ``payload`` (a CPU float32/float16/bfloat16 tensor) as the chunk ``key`` of
        ``token_ids`` now, then evict the least recently used chunks beyond max_bytes. A key
        already stored is not written again (a key names its whole prefix, so its K/V is the
        same), only made the most recently used. A write error pauses writes (see the module's
        docstring; one warning per streak of failures), never raises; a put while writes are
        paused is dropped (counted)."""
        _check_key(key)
        check_payload(payload)
        with self._lock:
            if self._closing:  # the folder may belong to another store by now
                self._counters["dropped_writes"] += 1
                return
            generation = self._generation
        if not self._touch_if_stored(key):
            self._write(key, token_ids, payload, generation)

    def put_async(
        self,
        key: str,
        token_ids: np.ndarray,
        payload: torch.Tensor,
        release: Callable[[], None] | None = None,
    ) -> bool:
        """Queue ``put`` for the writer thread. ``payload`` must be a CPU copy the caller does
        not touch again until ``release`` (if given) is called: once, on the writer thread
        after the write (or its drop), or before this returns when nothing was queued. True
        when queued or already stored (see ``put``); False (and counted in dropped_writes)
        when writes are paused, the store is closing, or the queue would exceed
        write_queue_bytes."""
        _check_key(key)
        check_payload(payload)
        queued = False
        try:
            if self._touch_if_stored(key):
                return True
            queued = self._enqueue(key, token_ids, payload, release)
            return queued
        finally:
            if not queued and release is not None:
                release()

    def _enqueue(
        self,
        key: str,
        token_ids: np.ndarray,
        payload: torch.Tensor,
        release: Callable[[], None] | None,
    ) -> bool:
        """Queue the write of ``key`` unless the queue cannot take it (dropped: counted);
        whether it was queued."""
        nbytes = payload.numel() * payload.element_size()
        with self._lock:
            if (
                self._closing
                or self._paused_locked()
                or self._queued_bytes + nbytes > self._write_queue_bytes
            ):
                self._counters["dropped_writes"] += 1
                return False
            self._queued_writes += 1
            self._queued_bytes += nbytes
            generation = self._generation
        write = _QueuedWrite(key, np.array(token_ids), payload, nbytes, generation, release)
        self._queue.put(write)
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write is done (or ``timeout`` seconds have passed)."""
        with self._idle:
            self._idle.wait_for(lambda: self._queued_writes == 0, timeout)

    def clear(self) -> None:
        """Delete every chunk, and drop the writes queued before this call (none after close)."""
        with self._lock:
            if self._closed:
                return
            self._generation += 1
            self._index.clear()
            self._used_bytes = 0
            delete_chunk_files(self.folder, include_temporary=False)

    def close(self) -> None:
        """Finish the queued writes, stop the writer thread and release the folder's lock.
        Idempotent; afterwards gets miss and puts are dropped."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self.flush()
        self._queue.put(None)
        self._writer.join()
        with self._lock:
            self._closed = True
        release_folder_lock(self._lock_fd)

    @property
    def writes_paused(self) -> bool:
        """Whether writes are paused after a write error (puts are dropped until the pause
        ends; loads go on)."""
        with self._lock:
            return self._paused_locked()

    def stats(self) -> dict[str, float | int]:
        """Counters since start (hits, misses, load_bytes, load_seconds, writes, write_bytes,
        write_errors, dropped_writes, evictions, bad_files) and the current used_bytes, chunks,
        queued_bytes and writes_paused (0/1)."""
        with self._lock:
            return {
                **self._counters,
                "load_seconds": self._load_seconds,
                "used_bytes": self._used_bytes,
                "chunks": len(self._index),
                "queued_bytes": self._queued_bytes,
                "writes_paused": int(self._paused_locked()),
            }

    # -- internals -----------------------------------------------------------------------

    def _chunk_path(self, key: str) -> Path:
        return chunk_path(self.folder, key)

    def _paused_locked(self) -> bool:
        return time.monotonic() < self._writes_paused_until

    def _touch_if_stored(self, key: str) -> bool:
        """Make ``key`` the most recently used if it is stored; whether it is."""
        with self._lock:
            if key not in self._index:
                return False
            self._index.move_to_end(key)
        touch_chunk(self.folder, key)
        return True

    def _write_loop(self) -> None:
        """The writer thread: one queued write at a time until close's None. Nothing raised by
        a write ends the loop."""
        while (item := self._queue.get()) is not None:
            try:
                self._write(item.key, item.token_ids, item.payload, item.generation)
            except Exception:
                logger.exception("KV disk write of chunk %s failed", item.key)
                with self._lock:
                    self._counters["write_errors"] += 1
            finally:
                if item.release is not None:
                    item.release()
                with self._idle:
                    self._queued_writes -= 1
                    self._queued_bytes -= item.nbytes
                    self._idle.notify_all()

    def _write(
        self, key: str, token_ids: np.ndarray, payload: torch.Tensor, generation: int
    ) -> None:
        nbytes_estimate = payload.numel() * payload.element_size()
        with self._lock:
            if self._paused_locked() or generation != self._generation:
                self._counters["dropped_writes"] += 1
                return
        if nbytes_estimate > self.max_bytes:  # would evict everything and still not fit
            with self._lock:
                self._counters["dropped_writes"] += 1
            return
        pieces = encode_chunk(key, token_ids, payload)
        temporary = f"{key}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        directory: int | None = None
        try:
            directory = open_fan_out(self.folder, key, create=True)
            size = _write_file(directory, temporary, pieces)
            with self._lock:
                if generation != self._generation:  # clear() ran while this was written
                    self._counters["dropped_writes"] += 1
                    return
                install_chunk(directory, temporary, key)
                self._write_failures = 0
                self._used_bytes += size - self._index.pop(key, 0)
                self._index[key] = size
                self._counters["writes"] += 1
                self._counters["write_bytes"] += size
                self._evict_locked()
        except OSError as e:
            self._pause_writes(e)
        finally:  # gone after the rename; else a torn or unwanted file
            if directory is not None:
                unlink_quietly(Path(temporary), directory)
                os.close(directory)

    def _pause_writes(self, error: OSError) -> None:
        """Count a failed write and pause writes for the streak's next backoff; warn at the
        first failure of a streak."""
        with self._lock:
            self._counters["write_errors"] += 1
            self._write_failures += 1
            pause = min(
                self.WRITE_RETRY_FIRST_S * 2 ** (self._write_failures - 1), self.WRITE_RETRY_MAX_S
            )
            self._writes_paused_until = time.monotonic() + pause
            first = self._write_failures == 1
        reason = errno.errorcode.get(error.errno or 0, "") if error.errno else ""
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "KV disk tier: a write to %s failed (%s%s); writes pause for %.0f s, then are "
            "tried again (each failure in a row doubles the pause, up to %.0f s); stored "
            "chunks are still read",
            self.folder,
            f"{reason}: " if reason else "",
            error.strerror or error,
            pause,
            self.WRITE_RETRY_MAX_S,
        )

    def _evict_locked(self) -> None:
        while self._used_bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            remove_chunk(self.folder, key)
            self._used_bytes -= size
            self._counters["evictions"] += 1

    def _forget_missing(self, key: str) -> None:
        """Drop ``key`` from the index if its file is gone (deleted behind the store's back)."""
        with self._lock:
            self._counters["misses"] += 1
            if key in self._index and chunk_stat(self.folder, key) is None:
                self._used_bytes -= self._index.pop(key)

    def _delete_bad(self, key: str, read: os.stat_result | None) -> None:
        """Remove what is at the name of ``key`` that failed to load, unless a write replaced
        it since (a different inode than the one read)."""
        with self._lock:
            self._counters["misses"] += 1
            self._counters["bad_files"] += 1
            remove_chunk(self.folder, key, read)
            if key in self._index:
                self._used_bytes -= self._index.pop(key)


def _write_file(directory: int, name: str, pieces: list[bytes | memoryview]) -> int:
    """Write ``pieces`` to a new regular file ``name`` in the folder open as ``directory``
    (a name already there, even a link, fails: FileExistsError); its size."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=directory,
    )
    with open(fd, "wb") as file:
        for piece in pieces:
            file.write(piece)
    return sum(piece.nbytes if isinstance(piece, memoryview) else len(piece) for piece in pieces)


def _touch(fd: int) -> None:
    """Set the mtime of the open file ``fd`` to now: the last use a restart's scan orders the
    LRU by."""
    try:
        os.utime(fd)
    except OSError:
        pass


def _check_key(key: object) -> None:
    if not is_chunk_key(key):
        raise ValueError(f"not a KV disk chunk key (64 lowercase hex digits): {key!r:.80}")

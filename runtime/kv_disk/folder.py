"""The folder a store owns: its lock file, its manifest and where chunk files live.

Layout of ``path/subfolder``: ``lock`` (held with flock by the one store using the folder),
``manifest.json`` (what the K/V stored here is valid for) and ``<key[:2]>/<key>.kv`` chunk
files (a two-hex-digit fan-out keeps each directory small), with ``*.tmp`` files beside them
while they are written. This module imports neither torch nor numpy.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from runtime.kv_disk.keys import is_chunk_key

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LOCK_NAME = "lock"
CHUNK_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_FAN_OUT = re.compile(r"[0-9a-f]{2}")


class KVDiskError(RuntimeError):
    """The store cannot start: a bad size or folder name, an unwritable folder, or a folder
    another store (in this or another process) holds."""


def chunk_path(folder: Path, key: str) -> Path:
    """Where the chunk ``key`` (a checked chunk key: hex only, so never outside ``folder``)
    lives."""
    return folder / key[:2] / f"{key}{CHUNK_SUFFIX}"


def take_folder_lock(folder: Path) -> int:
    """Hold ``folder/lock`` exclusively and write this process's id in it; the lock's file
    descriptor. flock is released when its holder dies, so a crash leaves no stale lock; it is
    per open file, so a second store in the same process is refused too. KVDiskError when
    another holds it."""
    lock_path = folder / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise KVDiskError(f"cannot create the lock file {lock_path}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise KVDiskError(
            f"the KV disk folder {folder} is in use by another server (process {holder} holds "
            f"{lock_path}); give each server its own --kv-disk-path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_folder_lock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def check_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Keep the folder's chunks if ``manifest`` equals its ``manifest.json``; else delete them,
    warn once naming what differs (no warning for a new, empty folder), and store ``manifest``.
    KVDiskError when it is not JSON-able."""
    try:
        wanted = json.loads(json.dumps(manifest))
    except (TypeError, ValueError) as e:
        raise KVDiskError(f"the KV disk manifest must be JSON-able: {e}") from e
    manifest_path = folder / MANIFEST_NAME
    stored: Any
    try:
        stored = json.loads(manifest_path.read_text("utf-8"))
    except FileNotFoundError:
        stored = None
    except (OSError, ValueError):
        stored = "unreadable"
    if stored == wanted:
        return
    deleted = delete_chunk_files(folder, include_temporary=True)
    if stored is not None or deleted:
        logger.warning(
            "KV disk tier %s was made for another model or setting (%s); deleted its %d chunks",
            folder,
            _manifest_difference(stored, wanted),
            deleted,
        )
    temporary = manifest_path.with_name(MANIFEST_NAME + TMP_SUFFIX)
    temporary.write_text(json.dumps(wanted, indent=1, sort_keys=True), "utf-8")
    os.replace(temporary, manifest_path)


def _manifest_difference(stored: Any, wanted: dict[str, Any]) -> str:
    if not isinstance(stored, dict):
        return "no manifest.json" if stored is None else "manifest.json unreadable"
    changed = [
        f"{name}: {stored.get(name, '<absent>')!r} -> {wanted.get(name, '<absent>')!r}"
        for name in sorted(stored.keys() | wanted.keys())
        if stored.get(name) != wanted.get(name)
    ]
    return "; ".join(changed)


def scan_chunks(folder: Path) -> list[tuple[str, int]]:
    """``(key, file size)`` of every chunk file in ``folder``, least recently used first (by
    mtime, which loads touch). Deletes the temporary files of writes a crash interrupted: call
    it only while no writer runs."""
    found = []
    for directory in _fan_out_dirs(folder):
        for entry in os.scandir(directory):
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                unlink_quietly(Path(entry.path))
            elif (
                name.endswith(CHUNK_SUFFIX)
                and is_chunk_key(key := name[: -len(CHUNK_SUFFIX)])
                and key[:2] == directory.name
                and entry.is_file(follow_symlinks=False)
            ):
                stat = entry.stat()
                found.append((stat.st_mtime_ns, key, stat.st_size))
    return [(key, size) for _, key, size in sorted(found)]


def delete_chunk_files(folder: Path, include_temporary: bool) -> int:
    """Delete every chunk file in ``folder`` (and temporary files, when no writer can be
    writing them); the number of chunk files deleted."""
    deleted = 0
    for directory in _fan_out_dirs(folder):
        for entry in os.scandir(directory):
            is_chunk = entry.name.endswith(CHUNK_SUFFIX)
            if is_chunk or (include_temporary and entry.name.endswith(TMP_SUFFIX)):
                deleted += is_chunk
                unlink_quietly(Path(entry.path))
    return deleted


def _fan_out_dirs(folder: Path) -> list[Path]:
    return [
        Path(entry.path)
        for entry in os.scandir(folder)
        if _FAN_OUT.fullmatch(entry.name) and entry.is_dir()
    ]


def unlink_quietly(path: Path) -> None:
    """Delete ``path`` if it can be (a file already gone, or not deletable, is left be)."""
    try:
        os.unlink(path)
    except OSError:
        pass

"""The folder a store owns: its lock file, its manifest and where chunk files live.

Layout of ``path/subfolder``: ``lock`` (held with flock by the one store using the folder),
``manifest.json`` (what the K/V stored here is valid for) and ``<key[:2]>/<key>.kv`` chunk
files (a two-hex-digit fan-out keeps each directory small), with ``*.tmp`` files beside them
while they are written. This module imports neither torch nor numpy.

Nothing inside the folder is followed: a fan-out folder is opened with ``O_NOFOLLOW`` and its
entries are read, written, renamed and deleted relative to that descriptor, so a link planted
in the tier (a file or a fan-out folder) never leads a read, a write or a delete outside it.
Only regular files are read, opened with ``O_NONBLOCK`` (a FIFO named like a chunk cannot
block the reader). The folder itself (``path/subfolder``, what the operator configured) may
be a link.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.kv_disk.keys import is_chunk_key

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LOCK_NAME = "lock"
CHUNK_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_FAN_OUT = re.compile(r"[0-9a-f]{2}")


# Opening a fan-out folder: a link there fails (ELOOP, or ENOTDIR for a non-folder).
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Opening a chunk to read: a link fails, a FIFO or device opens without waiting (then fstat
# refuses it).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Creating a temporary file: a new regular file only, never through a planted link.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class KVDiskError(RuntimeError):
    """The store cannot start: a bad size or folder name, an unwritable folder, or a folder
    another store (in this or another process) holds."""


class NotARegularFile(OSError):
    """What is at a chunk's name is not a regular file (a link, a FIFO, a folder, a device):
    it is never read."""


def chunk_path(folder: Path, key: str) -> Path:
    """Where the chunk ``key`` (a checked chunk key: hex only, so never outside ``folder``)
    lives."""
    return folder / key[:2] / chunk_name(key)


def chunk_name(key: str) -> str:
    """The chunk's file name inside its fan-out folder (``open_fan_out``)."""
    return f"{key}{CHUNK_SUFFIX}"


def open_fan_out(folder: Path, key: str, create: bool = False) -> int:
    """A descriptor of the fan-out folder of ``key`` (the caller closes it), opened without
    following a link. OSError when it is missing or not a real folder; with ``create`` a
    missing one is made, and a link or file in its place is removed (only the name: what a
    link points to is never touched) and replaced by a folder."""
    path = folder / key[:2]
    try:
        return os.open(path, _DIRECTORY_FLAGS)
    except OSError as e:
        if not create or e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise
        if e.errno != errno.ENOENT:
            os.unlink(path)
    try:
        os.mkdir(path)
    except FileExistsError:
        pass  # another thread made it
    return os.open(path, _DIRECTORY_FLAGS)


def open_chunk(folder: Path, key: str) -> tuple[int, os.stat_result]:
    """The chunk file of ``key`` open for reading, and its stat (the caller closes it).
    FileNotFoundError when it is missing; NotARegularFile when its name (or its fan-out
    folder) is a link, or it is not a regular file; it is checked before it is opened and
    again after, so neither a link nor a FIFO swapped in between is read or waited on."""
    try:
        directory = open_fan_out(folder, key)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        raise NotARegularFile(e.errno, f"the fan-out folder of {key} is not a folder") from e
    try:
        name = chunk_name(key)
        if not stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
            raise NotARegularFile(errno.EINVAL, f"chunk {key} is not a regular file")
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=directory)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise
            raise NotARegularFile(e.errno, f"chunk {key} cannot be opened: {e.strerror}") from e
    finally:
        os.close(directory)
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, f"chunk {key} is not a regular file")
    return fd, opened


def chunk_stat(folder: Path, key: str) -> os.stat_result | None:
    """The stat of whatever is at the chunk's name (a link is not followed); None when
    nothing is, or its fan-out folder is not a real folder."""
    try:
        directory = open_fan_out(folder, key)
    except OSError:
        return None
    try:
        return os.stat(chunk_name(key), dir_fd=directory, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(directory)


def remove_chunk(folder: Path, key: str, read: os.stat_result | None = None) -> None:
    """Remove whatever is at the chunk's name (a file, link or FIFO; a folder with what it
    holds, links inside it not followed), unless ``read`` is given and the name now holds
    another file (a write replaced the one read). A fan-out folder that is not a real folder
    is left be."""
    try:
        directory = open_fan_out(folder, key)
    except OSError:
        return
    try:
        name = chunk_name(key)
        if read is not None:
            try:
                now = os.stat(name, dir_fd=directory, follow_symlinks=False)
            except OSError:
                return
            if (now.st_ino, now.st_dev) != (read.st_ino, read.st_dev):
                return
        remove_entry(directory, name)
    finally:
        os.close(directory)


def touch_chunk(folder: Path, key: str) -> None:
    """Set the chunk's mtime to now (the last use a restart's scan orders the LRU by),
    without following a link; nothing when it cannot be."""
    try:
        directory = open_fan_out(folder, key)
    except OSError:
        return
    try:
        os.utime(chunk_name(key), dir_fd=directory, follow_symlinks=False)
    except OSError:
        pass
    finally:
        os.close(directory)


def install_chunk(directory: int, temporary: str, key: str) -> None:
    """Rename ``temporary`` (in the fan-out folder open as ``directory``) to the chunk's name,
    replacing what is there: a file or link (the name only), or a stray folder."""
    name = chunk_name(key)
    try:
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except IsADirectoryError:
        remove_entry(directory, name)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)


def take_folder_lock(folder: Path) -> int:
    """Hold ``folder/lock`` exclusively and write this process's id in it; the lock's file
    descriptor. flock is released when its holder dies, so a crash leaves no stale lock; it is
    per open file, so a second store in the same process is refused too. KVDiskError when
    another holds it."""
    lock_path = folder / LOCK_NAME
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(lock_path, flags, 0o644)
    except OSError as e:
        raise KVDiskError(f"cannot create the lock file {lock_path}: {e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KVDiskError(f"the lock file {lock_path} is not a regular file; remove it")
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
        stored = json.loads(_read_regular(manifest_path))
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
    unlink_quietly(temporary)
    fd = os.open(temporary, _CREATE_FLAGS, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(json.dumps(wanted, indent=1, sort_keys=True))
    os.replace(temporary, manifest_path)


def _read_regular(path: Path) -> str:
    """The text of ``path`` if it is a regular file (a link is not followed, a FIFO not
    waited on); OSError (FileNotFoundError when missing) otherwise."""
    fd = os.open(path, _READ_FLAGS)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(errno.EINVAL, f"{path} is not a regular file")
        return file.read().decode("utf-8")


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
    mtime, which loads touch). Deletes the temporary files of writes a crash interrupted, and
    whatever is named like a chunk but is not a regular file (a stray folder, a link, a FIFO):
    call it only while no writer runs."""
    found = []
    for directory, directory_name in _fan_out_dirs(folder):
        for entry in os.scandir(directory):
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                remove_entry(directory, name)
            elif (
                name.endswith(CHUNK_SUFFIX)
                and is_chunk_key(key := name[: -len(CHUNK_SUFFIX)])
                and key[:2] == directory_name
            ):
                if not entry.is_file(follow_symlinks=False):
                    remove_entry(directory, name)
                    continue
                entry_stat = entry.stat(follow_symlinks=False)
                found.append((entry_stat.st_mtime_ns, key, entry_stat.st_size))
    return [(key, size) for _, key, size in sorted(found)]


def delete_chunk_files(folder: Path, include_temporary: bool) -> int:
    """Delete every chunk file in ``folder``, and whatever else is named like one (a stray
    folder, a link: the name only); temporary files too when no writer can be writing them.
    A link named like a fan-out folder is removed, never followed. The number of names named
    like chunks deleted."""
    deleted = 0
    for directory, _ in _fan_out_dirs(folder):
        for entry in os.scandir(directory):
            is_chunk = entry.name.endswith(CHUNK_SUFFIX)
            if is_chunk or (include_temporary and entry.name.endswith(TMP_SUFFIX)):
                deleted += is_chunk
                remove_entry(directory, entry.name)
    for entry in os.scandir(folder):
        if _FAN_OUT.fullmatch(entry.name) and entry.is_symlink():
            unlink_quietly(Path(entry.path))
    return deleted


def _fan_out_dirs(folder: Path) -> Iterator[tuple[int, str]]:
    """``(descriptor, name)`` of each real fan-out folder in ``folder`` (links are skipped:
    opened with O_NOFOLLOW, so one swapped in after the listing fails to open), each closed
    when the caller moves on."""
    for entry in os.scandir(folder):
        if not _FAN_OUT.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            directory = os.open(entry.path, _DIRECTORY_FLAGS)
        except OSError:
            continue
        try:
            yield directory, entry.name
        finally:
            os.close(directory)


def remove_entry(directory: int, name: str) -> None:
    """Remove ``name`` from the folder open as ``directory``: a folder with all it holds
    (``shutil.rmtree``, which follows no link), anything else by its name only. Errors are
    ignored (already gone, or not removable)."""
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=directory, ignore_errors=True)
        else:
            os.unlink(name, dir_fd=directory)
    except OSError:
        pass


def unlink_quietly(path: Path, directory: int | None = None) -> None:
    """Delete ``path`` (relative to the folder open as ``directory``, if given) if it can be
    (a file already gone, or not deletable, is left be). Never follows a final link."""
    try:
        os.unlink(path, dir_fd=directory)
    except OSError:
        pass

"""Arbor's cache folder (``$ARBOR_CACHE_DIR``, else ``~/.cache/arbor``), and how folders in it
are built so that no reader ever sees half of one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ARBOR_CACHE_DIR") or Path.home() / ".cache" / "arbor")


@contextlib.contextmanager
def building(out: Path) -> Iterator[Path]:
    """A scratch folder beside ``out`` to build a folder in; on success it replaces ``out``
    in one rename (readers never see half a folder), on failure it is removed."""
    tmp = Path(
        tempfile.mkdtemp(prefix=".building-", dir=out.parent if out.parent.exists() else None)
    )
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """Hold a lock file beside ``out`` while checking and building it: processes starting
    together (a server's three) build it once and the rest wait and reuse it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield

"""Training text for test tokenizers: the Python standard library's own sources.

Every machine that runs Arbor has them, so a tokenizer can be trained offline. The
selection is deterministic for a seed on a given Python installation.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def stdlib_sources() -> list[Path]:
    """All ``*.py`` files of the interpreter's standard library, sorted, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def training_texts(seed: int, max_bytes: int) -> Iterator[str]:
    """Yield file contents, in a seed-determined order, until ``max_bytes`` have been read."""
    files = stdlib_sources()
    if not files:
        raise FileNotFoundError("no standard-library sources found to train a tokenizer on")
    random.Random(seed).shuffle(files)
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        total += len(text)
        if total >= max_bytes:
            return

"""The tool decision's calibrated thresholds on disk, one file per model and envelope shape.

Calibrating a threshold (``runtime.chat.tool_decision``) scores two dozen prompts: seconds
on a CPU. It depends only on the model, the prompts as this server renders them and the
numerics the scheduler runs with, so it is done once and kept in the cache folder
(``$ARBOR_CACHE_DIR/tool_thresholds``); a restart reads it back in milliseconds.

A file is named by the model's identity (``runtime.model_identity``: its config and weight
headers) and the shape, and holds the threshold with the digest of everything it was
calibrated from: the model's identity, the calibration prompts' token ids (so a changed chat
template, tokenizer, instruction text or prompt set misses), the tool names, the opening the
names are scored after, ``MIN_ACCURACY`` and the scheduler's dtype, quantization, KV dtype,
device, kernels and tensor parallelism. A file whose digest differs is calibrated anew and
replaced; an unreadable one is ignored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.cache_dir import cache_root

logger = logging.getLogger(__name__)

FOLDER = "tool_thresholds"
# Bumped when what a threshold means changes in a way the digest's inputs do not show.
FORMAT_VERSION = 1
# The scheduler's settings (its ``server_info``) that change the scores' numerics.
NUMERICS_FIELDS = ("dtype", "quantization", "kv_cache_dtype", "device", "kernel_backend", "tp_size")


@dataclass(frozen=True)
class Threshold:
    """A model's calibrated cut on the best tool name's score (None: unusable, the model
    picks the key itself) and the share of the calibration prompts it classifies."""

    value: float | None
    accuracy: float


def calibration_digest(
    identity: str,
    parallel: bool,
    prompts: Sequence[Sequence[int]],
    facts: dict[str, Any],
) -> str:
    """Hex SHA-256 of what a threshold was calibrated from (see the module docstring);
    ``facts`` holds the calibration's constants (names, opening, accuracy bar) and the
    scheduler's numerics."""
    payload = {
        "version": FORMAT_VERSION,
        "model": identity,
        "parallel": parallel,
        "prompts": [list(map(int, ids)) for ids in prompts],
        "facts": facts,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class ThresholdStore:
    """Threshold files under ``root`` (default: the cache folder's ``tool_thresholds``)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_root() / FOLDER

    def path(self, identity: str, parallel: bool) -> Path:
        shape = "parallel" if parallel else "one-call"
        return self.root / f"{identity[:32]}-{shape}.json"

    def load(self, identity: str, parallel: bool, digest: str) -> Threshold | None:
        """The stored threshold calibrated from ``digest``; None when there is none, it was
        calibrated from something else, or the file cannot be read."""
        path = self.path(identity, parallel)
        try:
            data = json.loads(path.read_text())
            if data.get("digest") != digest:
                return None
            value = data["value"]
            return Threshold(None if value is None else float(value), float(data["accuracy"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the unreadable tool threshold file %s: %s", path, exc)
            return None

    def save(self, identity: str, parallel: bool, digest: str, stored: Threshold) -> None:
        """Write the threshold in one rename (a reader never sees half a file); a failure to
        write is logged, never raised: the server then calibrates again at its next start."""
        path = self.path(identity, parallel)
        body = {"digest": digest, "value": stored.value, "accuracy": stored.accuracy}
        tmp: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".writing-", dir=path.parent)
            with os.fdopen(fd, "w") as file:
                json.dump(body, file)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            logger.warning("could not keep the tool threshold in %s: %s", path, exc)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

"""A request's token ids (prompt, then outputs) as one growing int32 array, converted from the
prompt's list once, so the radix tree and the admission checks get prefixes as views instead of
converting a Python list on every call (an 8k-token list costs ~90 µs to convert; a view,
nothing)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KEY_DTYPE = np.int32  # the radix tree's key dtype


class TokenArray:
    """Append-only: positions once written never change, so views handed out stay valid (a
    grown buffer leaves old views on the old one)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._data = np.empty(max(16, 2 * len(ids)), dtype=KEY_DTYPE)
        self._data[: len(ids)] = ids
        self._len = len(ids)

    def __len__(self) -> int:
        return self._len

    def append(self, token: int) -> None:
        if self._len == self._data.size:
            grown = np.empty(2 * self._data.size, dtype=KEY_DTYPE)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len] = token
        self._len += 1

    def prefix(self, n: int) -> np.ndarray:
        """The first ``n`` ids (all of them when n is larger), a read-only view."""
        view = self._data[: min(n, self._len)]
        view.flags.writeable = False
        return view

    def array(self) -> np.ndarray:
        """All the ids, a read-only view."""
        return self.prefix(self._len)

    def tolist(self, start: int, end: int) -> list[int]:
        """Ids ``[start, end)`` (clipped to the ids there are) as Python ints."""
        return self._data[start : min(end, self._len)].tolist()

"""A disk tier for the KV cache: page-aligned chunks of K/V kept in files under one folder.

``keys``: ``chunk_keys`` (a chain hash naming each chunk by its namespace and whole prefix) and
the key check. ``chunk_file``: one chunk's file format (header with the chunk's key, token
ids, payload, checksum). ``folder``: the folder's layout, lock file and manifest, its entries
reached without following links (regular files only), and ``KVDiskError``. ``store``:
``KVDiskStore`` (the LRU index, loads, writes and the writer thread). The scheduler's radix
cache decides what to store and load; this package only keeps bytes, and never returns data
it cannot prove is the data that was stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from runtime.kv_disk.folder import KVDiskError
    from runtime.kv_disk.keys import KEY_HEX_LENGTH, chunk_keys, is_chunk_key
    from runtime.kv_disk.store import KVDiskStore

__all__, __getattr__ = lazy_exports(__name__)

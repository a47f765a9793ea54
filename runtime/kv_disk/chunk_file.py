"""One chunk's file: a fixed header, the chunk's token ids, the K/V payload and a checksum.

Layout (little-endian), each section starting on a 64-byte boundary so the payload can be
viewed in place as its dtype::

    header   magic "ARKV", format version u16, token id width u8 (4 or 8), ndim u8,
             dtype name (16 bytes, NUL padded), token count u64, payload bytes u64,
             chunk key (32 bytes: the hash chain's value the file is stored under),
             shape (ndim x u64), zero padding
    tokens   token count x int32 or int64, zero padding
    payload  the tensor's bytes (float32, float16 or bfloat16, C order, native = little-endian)
    crc32    u32 over every byte before it

A file whose size, header, key, token ids or checksum disagree with what a load asks for is
rejected (``ChunkMismatch``), so a torn write, a truncated or flipped file, a file moved or
copied under another key (equal token ids, another prefix), or a key collision is a miss,
never wrong K/V.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from runtime.kv_disk.keys import KEY_HEX_LENGTH

MAGIC = b"ARKV"
# 2: the header holds the chunk's key (version 1 files, without it, are misses).
FORMAT_VERSION = 2
_HEADER = struct.Struct(f"<4sHBB16sQQ{KEY_HEX_LENGTH // 2}s")
_DIM = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_ALIGN = 64
# What get_into reads before the payload: the header and, for chunks up to 500 int64 token
# ids, the token ids (a longer head takes one more read).
_HEAD_READ = 4096
# Loads read and checksum this much at a time: a block stays in a core's L2 cache.
_READ_BLOCK = 256 << 10
# numpy has no bfloat16, so payloads travel as their bytes and are viewed back as the dtype.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_INT32 = np.iinfo(np.int32)


class ChunkMismatch(ValueError):
    """The file is not a valid chunk for the token ids asked for (the message says why)."""


class RequestMismatch(ChunkMismatch):
    """The file may be intact, but the load asked for something else: a different number of
    token ids, or an ``out`` tensor of another dtype or size (a caller's mistake, not the
    file's)."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def check_payload(payload: torch.Tensor) -> str:
    """The dtype name ``payload`` is stored under; ValueError unless it is a CPU tensor of a
    supported dtype with at most 255 dimensions."""
    name = _DTYPE_NAMES.get(payload.dtype)
    if name is None:
        raise ValueError(f"payload dtype must be one of {sorted(_DTYPES)}, got {payload.dtype}")
    if payload.device.type != "cpu":
        raise ValueError(f"payload must be a CPU tensor, got one on {payload.device}")
    if payload.dim() > 255:
        raise ValueError(f"payload has {payload.dim()} dimensions, at most 255 are stored")
    return name


def encode_chunk(
    key: str, token_ids: np.ndarray, payload: torch.Tensor
) -> list[bytes | memoryview]:
    """The file's bytes for ``payload`` (a CPU tensor of a supported dtype, any shape) holding
    the K/V of ``token_ids`` (1-D integers), stored under the chunk key ``key`` (checked by
    the caller: 64 hex digits), as pieces to write in order (the payload's piece is a view of
    its memory, not a copy)."""
    name = check_payload(payload)
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(f"token_ids must be 1-D integers, got {tokens.dtype} {tokens.shape}")
    fits_int32 = not tokens.size or (tokens.min() >= _INT32.min and tokens.max() <= _INT32.max)
    tokens = tokens.astype("<i4" if fits_int32 else "<i8", copy=False)
    data = payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        tokens.itemsize,
        payload.dim(),
        name.encode("ascii"),
        len(tokens),
        data.nbytes,
        bytes.fromhex(key),
    ) + b"".join(_DIM.pack(d) for d in payload.shape)
    header += bytes(_aligned(len(header)) - len(header))
    token_bytes = tokens.tobytes()
    token_bytes += bytes(_aligned(len(token_bytes)) - len(token_bytes))
    pieces: list[bytes | memoryview] = [header, token_bytes, data.data]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return [*pieces, _CRC.pack(crc)]


@dataclass(frozen=True)
class _Layout:
    """Where a file's sections are, from its header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    token_dtype: str  # "<i4" or "<i8"
    n_tokens: int
    token_start: int
    payload_start: int
    n_payload: int
    key: bytes  # the chunk key the file was written under

    @property
    def size(self) -> int:
        return self.payload_start + self.n_payload + _CRC.size


def decode_chunk(fd: int, size: int, key: str, token_ids: np.ndarray) -> torch.Tensor:
    """The payload stored in the file open as ``fd`` (``size`` bytes long), read with one read
    into a fresh buffer the returned tensor views. Raises ChunkMismatch when the file is not a
    whole, intact chunk written under ``key`` of exactly ``token_ids``; OSError when reading
    fails."""
    if size < _HEADER.size + _CRC.size:
        raise ChunkMismatch(f"{size} bytes is shorter than a header")
    buffer = torch.empty(size, dtype=torch.uint8)
    data = buffer.numpy().data  # a writable memoryview of the buffer
    crc = _read_summed(fd, data[: size - _CRC.size], 0, 0)
    _read_exactly(fd, data[size - _CRC.size :], size - _CRC.size)
    layout = _parse_header(data, size)
    _check_key_and_tokens(data, layout, key, token_ids)
    if crc != _CRC.unpack_from(data, size - _CRC.size)[0]:
        raise ChunkMismatch("checksum mismatch")
    payload = buffer[layout.payload_start : layout.payload_start + layout.n_payload]
    return payload.view(layout.dtype).reshape(layout.shape)


def decode_chunk_into(
    fd: int, size: int, key: str, token_ids: np.ndarray, out: torch.Tensor
) -> torch.Tensor:
    """Like ``decode_chunk``, but the payload's elements (C order) are read straight into
    ``out`` (a contiguous CPU tensor of the stored dtype and element count, e.g. a reused
    staging buffer: no fresh memory to fault in); returns ``out``. When this raises, ``out``
    holds garbage."""
    head = bytearray(min(size, _HEAD_READ))
    _read_exactly(fd, memoryview(head), 0)
    if size < _HEADER.size + _CRC.size:
        raise ChunkMismatch(f"{size} bytes is shorter than a header")
    layout = _parse_header(memoryview(head), size)
    if layout.payload_start > len(head):  # many token ids: read the rest of the head
        rest = bytearray(layout.payload_start - len(head))
        _read_exactly(fd, memoryview(rest), len(head))
        head += rest
    _check_key_and_tokens(memoryview(head), layout, key, token_ids)
    if out.dtype != layout.dtype or out.numel() * out.element_size() != layout.n_payload:
        raise RequestMismatch(
            f"stored {layout.dtype} {list(layout.shape)} does not fit {out.dtype} {list(out.shape)}"
        )
    target = out.reshape(-1).view(torch.uint8).numpy().data
    crc = zlib.crc32(memoryview(head)[: layout.payload_start])
    crc = _read_summed(fd, target, layout.payload_start, crc)
    trailer = bytearray(_CRC.size)
    _read_exactly(fd, memoryview(trailer), size - _CRC.size)
    if crc != _CRC.unpack(trailer)[0]:
        raise ChunkMismatch("checksum mismatch")
    return out


def _parse_header(data: memoryview, size: int) -> _Layout:
    """The layout the header at the start of ``data`` describes, checked against the file's
    ``size``; ChunkMismatch when it is not a plausible header."""
    magic, version, token_width, ndim, raw_name, n_tokens, n_payload, key = _HEADER.unpack_from(
        data
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ChunkMismatch(f"not a version {FORMAT_VERSION} chunk file")
    dtype = _DTYPES.get(raw_name.rstrip(b"\0").decode("ascii", "replace"))
    if dtype is None or token_width not in (4, 8):
        raise ChunkMismatch("unknown payload dtype or token id width")
    shape_end = _HEADER.size + ndim * _DIM.size
    if shape_end > min(size, len(data)):
        raise ChunkMismatch("truncated header")
    shape = tuple(_DIM.unpack_from(data, _HEADER.size + i * _DIM.size)[0] for i in range(ndim))
    token_start = _aligned(shape_end)
    layout = _Layout(
        dtype=dtype,
        shape=shape,
        token_dtype="<i4" if token_width == 4 else "<i8",
        n_tokens=n_tokens,
        token_start=token_start,
        payload_start=token_start + _aligned(n_tokens * token_width),
        n_payload=n_payload,
        key=key,
    )
    if layout.size != size:
        raise ChunkMismatch(f"{size} bytes, the header describes {layout.size}")
    element_size = torch.empty((), dtype=dtype).element_size()
    if n_payload != math.prod(shape) * element_size:
        raise ChunkMismatch("payload size disagrees with its shape")
    return layout


def _check_key_and_tokens(
    data: memoryview, layout: _Layout, key: str, token_ids: np.ndarray
) -> None:
    """ChunkMismatch unless the file was written under ``key``: two prefixes can hold equal
    token ids in a chunk, so the tokens alone do not tell a file moved from another key."""
    if layout.key != bytes.fromhex(key):
        raise ChunkMismatch("the file was written under another chunk key")
    stored = np.frombuffer(data, layout.token_dtype, layout.n_tokens, layout.token_start)
    expected = np.asarray(token_ids)
    if stored.shape != expected.shape:
        raise RequestMismatch(f"{layout.n_tokens} token ids stored, {expected.shape} asked for")
    if not np.array_equal(stored, expected):
        raise ChunkMismatch("stored token ids differ from the ones asked for")


def _read_summed(fd: int, target: memoryview, offset: int, crc: int) -> int:
    """Fill ``target`` from ``fd`` at ``offset`` and return ``crc`` folded over it, a block at
    a time: each block is summed while it is still in the CPU's cache (about 1.5x faster than
    reading everything, then summing it from memory)."""
    for start in range(0, len(target), _READ_BLOCK):
        block = target[start : start + _READ_BLOCK]
        _read_exactly(fd, block, offset + start)
        crc = zlib.crc32(block, crc)
    return crc


def _read_exactly(fd: int, target: memoryview, offset: int) -> None:
    """Fill ``target`` from ``fd`` at ``offset``; a file that ends early (it shrank) is a
    ChunkMismatch."""
    done = 0
    while done < len(target):
        n = os.preadv(fd, [target[done:]], offset + done)
        if not n:
            raise ChunkMismatch(f"file ended after {done} of {len(target)} bytes")
        done += n

"""One chunk's file: a fixed header, the chunk's token ids, the K/V payload and a checksum.

Layout (little-endian), each section starting on a 64-byte boundary so the payload can be
viewed in place as its dtype::

    header   magic "ARKV", format version u16, token id width u8 (4 or 8), ndim u8,
             dtype name (16 bytes, NUL padded), token count u64, payload bytes u64,
             shape (ndim x u64), zero padding
    tokens   token count x int32 or int64, zero padding
    payload  the tensor's bytes (float32, float16 or bfloat16, C order)
    crc32    u32 over every byte before it

A file whose size, header, token ids or checksum disagree is rejected (``ChunkMismatch``), so a
torn write, a truncated or flipped file, or a key collision is a miss, never wrong K/V.
"""

from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
import torch

MAGIC = b"ARKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBB16sQQ")
_DIM = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_ALIGN = 64
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


def encode_chunk(token_ids: np.ndarray, payload: torch.Tensor) -> list[bytes | memoryview]:
    """The file's bytes for ``payload`` (a CPU tensor of a supported dtype, any shape) holding
    the K/V of ``token_ids`` (1-D integers), as pieces to write in order (the payload's piece
    is a view of its memory, not a copy)."""
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
    ) + b"".join(_DIM.pack(d) for d in payload.shape)
    header += bytes(_aligned(len(header)) - len(header))
    token_bytes = tokens.tobytes()
    token_bytes += bytes(_aligned(len(token_bytes)) - len(token_bytes))
    pieces: list[bytes | memoryview] = [header, token_bytes, data.data]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return [*pieces, _CRC.pack(crc)]


def decode_chunk(file: io.RawIOBase, size: int, token_ids: np.ndarray) -> torch.Tensor:
    """The payload stored in ``file`` (opened unbuffered, ``size`` bytes long), read with one
    read into a fresh buffer the returned tensor views. Raises ChunkMismatch when the file is
    not a whole, intact chunk of exactly ``token_ids``; OSError when reading fails."""
    if size < _HEADER.size + _CRC.size:
        raise ChunkMismatch(f"{size} bytes is shorter than a header")
    buffer = torch.empty(size, dtype=torch.uint8)
    data = buffer.numpy().data  # a writable memoryview of the buffer
    _read_exactly(file, data)
    magic, version, token_width, ndim, raw_name, n_tokens, n_payload = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ChunkMismatch(f"not a version {FORMAT_VERSION} chunk file")
    dtype = _DTYPES.get(raw_name.rstrip(b"\0").decode("ascii", "replace"))
    if dtype is None or token_width not in (4, 8):
        raise ChunkMismatch("unknown payload dtype or token id width")
    shape_end = _HEADER.size + ndim * _DIM.size
    if shape_end > size:
        raise ChunkMismatch("truncated header")
    shape = [_DIM.unpack_from(data, _HEADER.size + i * _DIM.size)[0] for i in range(ndim)]
    token_start = _aligned(shape_end)
    payload_start = token_start + _aligned(n_tokens * token_width)
    if payload_start + n_payload + _CRC.size != size:
        raise ChunkMismatch(f"{size} bytes, the header describes {payload_start + n_payload + 4}")
    element_size = torch.empty((), dtype=dtype).element_size()
    if n_payload != math.prod(shape) * element_size:
        raise ChunkMismatch("payload size disagrees with its shape")
    stored = np.frombuffer(data, "<i4" if token_width == 4 else "<i8", n_tokens, token_start)
    expected = np.asarray(token_ids)
    if stored.shape != expected.shape or not np.array_equal(stored, expected):
        raise ChunkMismatch("stored token ids differ from the ones asked for")
    (crc,) = _CRC.unpack_from(data, size - _CRC.size)
    if zlib.crc32(data[: size - _CRC.size]) != crc:
        raise ChunkMismatch("checksum mismatch")
    payload = buffer[payload_start : payload_start + n_payload]
    return payload.view(dtype).reshape(shape)


def _read_exactly(file: io.RawIOBase, target: memoryview) -> None:
    """Fill ``target`` from ``file``; a file that ends early (it shrank) is a ChunkMismatch."""
    done = 0
    while done < len(target):
        n = file.readinto(target[done:])
        if not n:
            raise ChunkMismatch(f"file ended after {done} of {len(target)} bytes")
        done += n

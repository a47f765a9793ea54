"""gather_kv_chunks: the KV disk tier's copy of chunks out of the pool, reference and native."""

from __future__ import annotations

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels import cpu_native
from arbor_kernels.reference.kv_chunks import gather_kv_chunks as reference

LAYERS, SLOTS, HEADS, DIM, T = 3, 64, 2, 8, 4


def _pool(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(SLOTS, HEADS, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, HEADS, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    return k, v


def _case() -> tuple[torch.Tensor, torch.Tensor]:
    # Three chunks, scattered and out of order in the pool, into rows 4, 0 and 2 of five.
    slots = torch.tensor([9, 3, 40, 41, 63, 0, 17, 18, 30, 31, 32, 5], dtype=torch.int64)
    return slots, torch.tensor([4, 0, 2], dtype=torch.int64)


def _expected(out: torch.Tensor, k: list, v: list, slots: torch.Tensor, rows: torch.Tensor):
    expected = out.clone()
    for c, row in enumerate(rows.tolist()):
        for layer in range(LAYERS):
            for t in range(T):
                slot = int(slots[c * T + t])
                expected[row, layer, 0, t] = k[layer][slot]
                expected[row, layer, 1, t] = v[layer][slot]
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_copies_each_chunk_to_its_row_and_nothing_else(dtype: torch.dtype) -> None:
    k, v = _pool(dtype)
    slots, rows = _case()
    out = torch.full((5, LAYERS, 2, T, HEADS, DIM), 7.0, dtype=dtype)
    expected = _expected(out, k, v, slots, rows)
    reference(out, rows, k, v, slots)
    assert torch.equal(out, expected)
    assert torch.equal(out[[1, 3]], torch.full_like(out[[1, 3]], 7.0))  # rows not named


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_equals_reference_bit_for_bit(dtype: torch.dtype) -> None:
    if not kernels.native_available():
        pytest.fail("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    ext = cpu_native.load()
    k, v = _pool(dtype)
    slots, rows = _case()
    out = torch.full((5, LAYERS, 2, T, HEADS, DIM), 7.0, dtype=dtype)
    expected = out.clone()
    reference(expected, rows, k, v, slots)
    ext.gather_kv_chunks(out, rows, k, v, slots)
    assert torch.equal(out, expected)
    with pytest.raises(RuntimeError, match="out of the pool"):
        ext.gather_kv_chunks(out, rows, k, v, torch.full_like(slots, SLOTS))
    with pytest.raises(RuntimeError, match="out of range"):
        ext.gather_kv_chunks(out, torch.tensor([0, 1, 5]), k, v, slots)

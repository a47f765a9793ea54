"""Deterministic mode (``kernels.set_deterministic``) in the native CPU kernels: a query's
attention is the same bits from extend or decode, whole or chunked, alone or batched, and
``fixed_order_linear`` gives a row the same bits whatever rows come with it."""

from __future__ import annotations

from collections.abc import Iterator

import arbor_kernels as kernels
import pytest
import torch
import torch.nn.functional as F
from arbor_kernels import dispatch

SCALE = 0.125
SEQ = 600  # past 512 keys: alone, a decode would split over threads without the mode


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    if not kernels.native_available():
        pytest.fail("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    kernels.set_deterministic(True)
    yield
    kernels.set_deterministic(False)


def _pool(kv_heads: int, dim: int, dtype: torch.dtype, seqs: int = 9) -> tuple[torch.Tensor, ...]:
    """K/V for ``seqs`` sequences of SEQ tokens at scattered slots: (k, v, table)."""
    gen = torch.Generator().manual_seed(0)
    slots = seqs * SEQ + 1
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(slots, generator=gen)[: seqs * SEQ].view(seqs, SEQ).contiguous()
    return k, v, table


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (9, 3), (8, 2)])  # groups of 1, 3, 4
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_query_is_the_same_however_it_is_batched(
    window: int, heads: int, kv_heads: int, kv_dtype: torch.dtype
) -> None:
    dim = 64
    k, v, table = _pool(kv_heads, dim, kv_dtype)
    q = torch.randn(SEQ, heads, dim, generator=torch.Generator().manual_seed(1))
    row0, full = torch.tensor([0]), torch.tensor([SEQ])
    whole = kernels.extend_attention(q, k, v, table, row0, full, full, SCALE, window)
    for cut in (1, 63, 64, 300, SEQ - 1):
        part = kernels.extend_attention(
            q[cut:], k, v, table, row0, full, torch.tensor([SEQ - cut]), SCALE, window
        )
        assert torch.equal(part, whole[cut:]), cut
    for length in (1, 64, 65, 450, SEQ):  # each position's query as a decode, alone
        lens = torch.tensor([length])
        alone = kernels.decode_attention(
            q[length - 1 : length], k, v, table, row0, lens, SCALE, window
        )
        assert torch.equal(alone[0], whole[length - 1]), length
    # The last query in a decode batch of 9 sequences of other lengths.
    rows = torch.arange(9)
    lens = torch.tensor([SEQ, 3, 64, 100, 200, 333, 512, 599, 1])
    batch_q = torch.cat([q[-1:], torch.randn(8, heads, dim)])
    batched = kernels.decode_attention(batch_q, k, v, table, rows, lens, SCALE, window)
    assert torch.equal(batched[0], whole[-1])


def test_fixed_order_linear_gives_a_row_the_same_bits_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(37, 300, generator=gen)  # n and k not multiples of the tiles
    bias = torch.randn(37, generator=gen)
    x = torch.randn(23, 300, generator=gen)
    for impl in (dispatch._impls["fixed_order_linear"]["native"], kernels.fixed_order_linear):
        y = impl(x, weight, bias)
        for m in range(23):
            assert torch.equal(impl(x[m : m + 1], weight, bias)[0], y[m]), m
        assert torch.equal(impl(x[5:12], weight, bias), y[5:12])
        torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    half = kernels.fixed_order_linear(x.bfloat16().view(23, 1, 300), weight, None)
    assert half.dtype == torch.bfloat16 and half.shape == (23, 1, 37)
    reference = dispatch._impls["fixed_order_linear"]["torch"](x, weight, bias)
    torch.testing.assert_close(reference, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)

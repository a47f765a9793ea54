"""The native CPU kernels (kernels/cpu_native) equal the torch reference, and their absence
falls back to the reference with one warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels import cpu_native, dispatch
from arbor_kernels.reference import attention as reference
from arbor_kernels.reference import cascade as cascade_ref
from arbor_kernels.reference import elementwise as elementwise_ref

from tests.kernels.kv_cases import (
    assert_close,
    dense_attention,
    paged_batch,
    poison_outside_windows,
)

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(2, 2), (8, 2), (7, 1)]  # groups of 1, 4 and 7 query heads per KV head


@pytest.fixture(scope="module")
def native() -> SimpleNamespace:
    """The registered native implementations by op name, and the extension as ``ext``."""
    if not kernels.native_available():
        pytest.fail("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    ops = {op: impls["native"] for op, impls in dispatch._impls.items() if "native" in impls}
    return SimpleNamespace(ext=cpu_native.load(), **ops)


def _queries(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, dim, generator=gen).to(dtype)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_extend_matches_reference(
    native: SimpleNamespace, page_size: int, heads: int, kv_heads: int, kv_dtype: torch.dtype
) -> None:
    # Fresh prefills, prefixes with short and long extensions, one-token extends, a length
    # ending mid-page and queries spanning several query blocks.
    seq_lens, extend_lens = [1, 19, 70, 45, 300, 33], [1, 19, 3, 45, 40, 1]
    batch = paged_batch(seq_lens, extend_lens, kv_heads, 32, page_size, kv_dtype, seed=3)
    q_dtype = torch.float32 if kv_dtype == torch.float32 else kv_dtype
    q = _queries(sum(extend_lens), heads, 32, q_dtype, seed=4)
    args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, 0.17)
    out = native.ext.extend_attention(q, batch.k_buffer, batch.v_buffer, *args, 0)
    ref = batch.finite()  # the native kernel reads the NaN-poisoned pool in place
    expected = reference.extend_attention(q, ref.k_buffer, ref.v_buffer, *args)
    assert out.dtype == q_dtype
    assert_close(out, expected, q_dtype)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_decode_matches_reference(
    native: SimpleNamespace, page_size: int, heads: int, kv_heads: int, kv_dtype: torch.dtype
) -> None:
    seq_lens = [1, 19, 70, 33, 1000]  # the long one is split over keys (one torch thread here)
    batch = paged_batch(seq_lens, [1] * len(seq_lens), kv_heads, 32, page_size, kv_dtype, 5)
    q = _queries(len(seq_lens), heads, 32, torch.float32, seed=6)
    args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 0.2)
    out = native.decode_attention(q, batch.k_buffer, batch.v_buffer, *args)
    ref = batch.finite()
    expected = reference.decode_attention(q, ref.k_buffer.float(), ref.v_buffer.float(), *args)
    # K/V rounding is in both sides' inputs; only the arithmetic differs.
    assert_close(out, expected, torch.float32)


def test_decode_splits_over_a_long_single_sequence(native: SimpleNamespace) -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        batch = paged_batch([4000], [1], 1, 64, 16, torch.float32, seed=7)
        q = _queries(1, 4, 64, torch.float32, seed=8)
        args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 0.125)
        out = native.decode_attention(q, batch.k_buffer, batch.v_buffer, *args)
        ref = batch.finite()
        assert_close(out, reference.decode_attention(q, ref.k_buffer, ref.v_buffer, *args),
                     torch.float32)  # fmt: skip
    torch.set_num_threads(1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_with_lse_over_a_suffix(native: SimpleNamespace, kv_dtype: torch.dtype) -> None:
    seq_lens = [5, 40, 90, 300]
    batch = paged_batch(seq_lens, [1] * 4, 2, 32, 16, kv_dtype, seed=9)
    q = _queries(4, 8, 32, torch.float32, seed=10)
    kv_start = torch.tensor([0, 17, 89, 250])
    args = (batch.req_to_token, batch.req_pool_indices, kv_start, batch.seq_lens, 0.2)
    out, lse = native.decode_attention_with_lse(q, batch.k_buffer, batch.v_buffer, *args, 0)
    ref = batch.finite()
    expected, expected_lse = cascade_ref.decode_attention_with_lse(
        q, ref.k_buffer, ref.v_buffer, *args
    )
    assert_close(out, expected, torch.float32)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_shared_prefix_matches_reference(
    native: SimpleNamespace, heads: int, kv_heads: int, kv_dtype: torch.dtype
) -> None:
    # Groups of 1, 3 and 70 sharers (70: three sharer blocks) over prefixes of 1, 45 (mid-page)
    # and 300 tokens, plus an empty prefix; the pool is NaN past each prefix, so reading a key
    # beyond it shows.
    seq_lens = [1, 45, 300, 64]
    batch = paged_batch(seq_lens, [1] * len(seq_lens), kv_heads, 32, 16, kv_dtype, seed=14)
    prefix_rows = batch.req_pool_indices
    prefix_lens = torch.tensor([1, 45, 300, 0])
    offsets = torch.tensor([0, 1, 4, 74, 76])
    q_dtype = torch.float32 if kv_dtype == torch.float32 else kv_dtype
    q = _queries(76, heads, 32, q_dtype, seed=15)
    args = (batch.req_to_token, prefix_rows, offsets, prefix_lens, 0.2)
    out, lse = native.shared_prefix_attention(q, batch.k_buffer, batch.v_buffer, *args)
    ref = batch.finite()
    expected, expected_lse = cascade_ref.shared_prefix_attention(
        q, ref.k_buffer.float(), ref.v_buffer.float(), *args
    )
    assert out.dtype == q_dtype and lse.dtype == torch.float32
    assert_close(out[:74], expected[:74], q_dtype)
    torch.testing.assert_close(lse[:74], expected_lse[:74], atol=2e-5, rtol=2e-5)
    # An empty prefix: lse -inf, and the output is never read (merging gives it no weight).
    assert bool((lse[74:] == float("-inf")).all())


def _cascade_case(
    page_size: int, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
    """Two sharer groups and two loners in one decode batch, built as fork branches: each
    branch's table row repeats its group leader's slots for the shared prefix (which ends
    mid-page) and has slots of its own after it. Returns (k, v, table, rows, groups, prefixes)
    with groups listing batch indices."""
    seq_lens = [70, 75, 71, 90, 40, 41, 33, 120]
    batch = paged_batch(seq_lens, [1] * len(seq_lens), 2, 32, page_size, kv_dtype, seed=11)
    table, rows = batch.req_to_token.clone(), batch.req_pool_indices
    groups, prefixes = [[0, 1, 2, 3], [4, 5]], [37, 29]  # 37 and 29: not page multiples
    for members, prefix in zip(groups, prefixes, strict=True):
        leader = int(rows[members[0]])
        for b in members[1:]:
            table[int(rows[b]), :prefix] = table[leader, :prefix]
    return batch.k_buffer, batch.v_buffer, table, rows, groups, prefixes


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_cascade_equals_plain_decode(
    native: SimpleNamespace, page_size: int, kv_dtype: torch.dtype, backend: str
) -> None:
    previous = kernels.kernel_backend()
    kernels.set_kernel_backend(backend)
    try:
        _check_cascade(page_size, kv_dtype)
    finally:
        kernels.set_kernel_backend(previous)


def _check_cascade(page_size: int, kv_dtype: torch.dtype) -> None:
    impl = kernels
    k, v, table, rows, groups, prefixes = _cascade_case(page_size, kv_dtype)
    seq_lens = torch.tensor([70, 75, 71, 90, 40, 41, 33, 120])
    q = _queries(8, 8, 32, torch.float32, seed=12)
    plain = reference.decode_attention(
        q, k.nan_to_num(0).float(), v.nan_to_num(0).float(), table, rows, seq_lens, 0.2
    )
    kv_start = torch.zeros(8, dtype=torch.int64)
    for members, prefix in zip(groups, prefixes, strict=True):
        kv_start[members] = prefix
    out, lse = impl.decode_attention_with_lse(q, k, v, table, rows, kv_start, seq_lens, 0.2)
    sharers = torch.tensor([b for members in groups for b in members])
    offsets = torch.tensor([0, 4, 6])
    leaders = rows[[members[0] for members in groups]]
    shared_out, shared_lse = impl.shared_prefix_attention(
        q[sharers], k, v, table, leaders, offsets, torch.tensor(prefixes), 0.2
    )
    own_out, own_lse = out[sharers], lse[sharers]
    impl.merge_attention_states(own_out, own_lse, shared_out, shared_lse)
    out[sharers] = own_out
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


def test_merge_with_an_empty_side_keeps_the_other(native: SimpleNamespace) -> None:
    out_a = torch.randn(3, 2, 8)
    lse_a = torch.randn(3, 2)
    kept, kept_lse = out_a.clone(), lse_a.clone()
    native.merge_attention_states(
        out_a, lse_a, torch.randn(3, 2, 8), torch.full((3, 2), -torch.inf)
    )
    torch.testing.assert_close(out_a, kept)
    torch.testing.assert_close(lse_a, kept_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_match_reference(native: SimpleNamespace, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(37, 96, generator=gen).to(dtype)
    residual = torch.randn(37, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)

    close(native.rms_norm(x, weight, 1e-6), elementwise_ref.rms_norm(x, weight, 1e-6))
    for got, want in zip(
        native.fused_add_rms_norm(x, residual, weight, 1e-6),
        elementwise_ref.fused_add_rms_norm(x, residual, weight, 1e-6),
        strict=True,
    ):
        close(got, want)
    gate_up = torch.randn(37, 2 * 48, generator=gen).to(dtype)
    close(native.silu_and_mul(gate_up), elementwise_ref.silu_and_mul(gate_up))
    # q and k as the model makes them: views into one projection output.
    qkv = torch.randn(37, (4 + 2 + 2) * 32, generator=gen).to(dtype)
    q = qkv[:, : 4 * 32].view(37, 4, 32)
    k = qkv[:, 4 * 32 : 6 * 32].view(37, 2, 32)
    positions = torch.arange(37) * 3
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    for got, want in zip(
        native.apply_rotary_emb(q, k, emb.cos(), emb.sin()),
        elementwise_ref.apply_rotary_emb(q, k, emb.cos(), emb.sin()),
        strict=True,
    ):
        close(got, want)


def _python(code: str, cache_dir: str, backend: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ARBOR_CACHE_DIR": cache_dir, "ARBOR_KERNEL_BACKEND": backend}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [64, 100, 1000, 1031])
@pytest.mark.parametrize("indexed", [False, True])
def test_token_bitmask_matches_reference(
    native: SimpleNamespace, dtype: torch.dtype, vocab: int, indexed: bool
) -> None:
    from arbor_kernels.reference import sampling as sampling_ref

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    # Words of every kind: all allowed, none, random; one word short of the vocabulary for the
    # odd sizes (the tokens past it are banned), one past it for 64.
    words = (vocab + 31) // 32 - (1 if vocab % 32 else -1)
    rows = 3 if indexed else 5
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, :] = -1
    bitmask[1, : words // 2] = 0
    indices = torch.tensor([4, 0, 2]) if indexed else None
    expected = logits.clone()
    sampling_ref.apply_token_bitmask(expected, bitmask, indices)
    native.apply_token_bitmask(logits, bitmask, indices)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_max_argmax_matches_reference(native: SimpleNamespace, dtype: torch.dtype) -> None:
    from arbor_kernels.reference import sampling as sampling_ref

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 1037, generator=gen).to(dtype)
    logits[1, :] = float("-inf")  # every token banned: max -inf at index 0
    logits[2, 5] = logits[2, 900] = 50.0  # a tie goes to the first
    logits[3, 17] = float("nan")
    logits[4, 1036] = 40.0  # the max in the tail past the last full block of lanes
    logits[5, :] = float("-inf")
    logits[5, 3] = float("nan")
    values, indices = native.row_max_argmax(logits)
    expected_values, expected_indices = sampling_ref.row_max_argmax(logits)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(
        values,
        expected_values,
    ) or torch.allclose(values.float(), expected_values.float(), equal_nan=True)
    assert values.dtype == dtype and torch.isnan(values[[3, 5]]).all()


def test_without_a_build_auto_falls_back_to_the_reference_with_one_warning(
    tmp_path: Path,
) -> None:
    code = (
        "import torch, kernels\n"
        "from arbor_kernels import dispatch\n"
        "for op in ('decode_attention', 'extend_attention', 'rms_norm'):\n"
        "    print(dispatch.resolve(op, torch.device('cpu')).__module__)\n"
    )
    done = _python(code, str(tmp_path), "auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["arbor_kernels.reference.attention"] * 2 + [
        "arbor_kernels.reference.elementwise"
    ]
    assert done.stderr.count("native CPU kernels unavailable") == 1, done.stderr
    assert "python -m arbor_kernels.cpu_native" in done.stderr


def test_without_a_build_forcing_native_names_the_cause(tmp_path: Path) -> None:
    code = "import arbor_kernels as k; k.set_kernel_backend('native')"
    done = _python(code, str(tmp_path), "auto")
    assert done.returncode != 0
    assert "kernel backend 'native' requested but unavailable" in done.stderr


def test_a_failed_build_does_not_fail_the_install_step(tmp_path: Path) -> None:
    # A compiler that cannot run stands in for a broken toolchain.
    env = {**os.environ, "ARBOR_CACHE_DIR": str(tmp_path), "CXX": "/nonexistent/c++"}
    done = subprocess.run(
        [sys.executable, "-m", "arbor_kernels.cpu_native"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0
    assert "native CPU kernels failed to build" in done.stderr
    strict = subprocess.run(
        [sys.executable, "-m", "arbor_kernels.cpu_native", "--strict"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert strict.returncode == 1


def test_shared_prefix_refuses_bad_plans(native: SimpleNamespace) -> None:
    batch = paged_batch([40], [1], 2, 32, 16, torch.float32, seed=16)
    q = _queries(2, 4, 32, torch.float32, seed=17)
    table = batch.req_to_token
    ok = (torch.tensor([int(batch.req_pool_indices[0])]), torch.tensor([0, 2]), torch.tensor([40]))
    native.shared_prefix_attention(q, batch.k_buffer, batch.v_buffer, table, *ok, 0.2)
    bad = {
        "prefix row out of range": (torch.tensor([table.shape[0]]), ok[1], ok[2]),
        "prefix length out of range": (ok[0], ok[1], torch.tensor([table.shape[1] + 1])),
        "sharer_offsets must run from 0": (ok[0], torch.tensor([0, 3]), ok[2]),
        "one more entry": (ok[0], torch.tensor([0, 1, 2]), ok[2]),
    }
    for message, (rows, offsets, lens) in bad.items():
        with pytest.raises(RuntimeError, match=message):
            native.shared_prefix_attention(
                q, batch.k_buffer, batch.v_buffer, table, rows, offsets, lens, 0.2
            )


# Sequence lengths 1, 19, 70, 45, 300, 33 (prefixes 0, 0, 67, 0, 260, 32): windows of one
# token, shorter than most sequences, equal to two of them (19, 70; 64: a query block), and
# longer than all.
EXTEND_SEQ_LENS, EXTEND_LENS = [1, 19, 70, 45, 300, 33], [1, 19, 3, 45, 90, 1]
WINDOWS = [1, 5, 19, 64, 70, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 32), (4, 1, 256)])
def test_extend_window_matches_the_dense_oracle(
    native: SimpleNamespace, window: int, heads: int, kv_heads: int, dim: int
) -> None:
    # (4, 1, 256): Gemma 3 270M's heads.
    batch = paged_batch(EXTEND_SEQ_LENS, EXTEND_LENS, kv_heads, dim, 16, torch.float32, seed=16)
    q = _queries(sum(EXTEND_LENS), heads, dim, torch.float32, seed=17)
    expected = dense_attention(q, batch, dim**-0.5, window).float()
    poisoned = poison_outside_windows(batch, window)
    out = native.extend_attention(
        q, poisoned.k_buffer, poisoned.v_buffer, poisoned.req_to_token,
        poisoned.req_pool_indices, poisoned.seq_lens, poisoned.extend_lens, dim**-0.5, window,
    )  # fmt: skip
    assert out.isfinite().all()  # nothing outside the windows was read
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", [1, 16, 33, 500, 4000])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 32), (4, 1, 256)])
def test_decode_window_matches_the_dense_oracle(
    native: SimpleNamespace, window: int, heads: int, kv_heads: int, dim: int
) -> None:
    # 3000 keys are split over threads; under a window only the window's keys are.
    seq_lens = [1, 19, 70, 33, 3000]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        batch = paged_batch(seq_lens, [1] * len(seq_lens), kv_heads, dim, 16, torch.float32, 18)
        q = _queries(len(seq_lens), heads, dim, torch.float32, seed=19)
        expected = dense_attention(q, batch, dim**-0.5, window).float()
        poisoned = poison_outside_windows(batch, window)
        args = (poisoned.req_to_token, poisoned.req_pool_indices, poisoned.seq_lens, dim**-0.5)
        out = native.decode_attention(q, poisoned.k_buffer, poisoned.v_buffer, *args, window)
        assert out.isfinite().all()
        assert_close(out, expected, torch.float32)
    torch.set_num_threads(1)


@pytest.mark.parametrize("window", [1, 20, 60, 1000])
def test_decode_with_lse_under_a_window(native: SimpleNamespace, window: int) -> None:
    # kv_start and the window each cut the range first in some request.
    batch = paged_batch([5, 40, 90, 300], [1] * 4, 2, 32, 16, torch.float32, seed=20)
    q = _queries(4, 8, 32, torch.float32, seed=21)
    kv_start = torch.tensor([0, 17, 80, 250])
    args = (batch.req_to_token, batch.req_pool_indices, kv_start, batch.seq_lens, 0.2, window)
    out, lse = native.decode_attention_with_lse(q, batch.k_buffer, batch.v_buffer, *args)
    expected, expected_lse = cascade_ref.decode_attention_with_lse(
        q, batch.k_buffer, batch.v_buffer, *args
    )
    assert_close(out, expected, torch.float32)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=2e-5)
    # The reference itself: over the window's part of [kv_start, seq_len), as dense attention
    # with that part's keys is.
    first = torch.maximum(kv_start, batch.seq_lens - window)
    plain, _ = cascade_ref.decode_attention_with_lse(
        q, batch.k_buffer, batch.v_buffer, *args[:2], first, *args[3:5]
    )
    assert_close(expected, plain, torch.float32)


def test_the_ops_default_to_no_window(native: SimpleNamespace) -> None:
    # Callers that pass no window (positionally or not) get full causal attention, as before.
    batch = paged_batch([19, 70], [4, 1], 2, 32, 16, torch.float32, seed=22)
    q = _queries(5, 8, 32, torch.float32, seed=23)
    args = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices)
    lens = (batch.seq_lens, batch.extend_lens)
    full = kernels.extend_attention(q, *args, *lens, 0.2, 0)
    assert torch.equal(kernels.extend_attention(q, *args, *lens, 0.2), full)
    assert torch.equal(kernels.extend_attention(q, *args, *lens, sm_scale=0.2), full)
    windowed = kernels.extend_attention(q, *args, *lens, 0.2, window=3)
    assert torch.equal(kernels.extend_attention(q, *args, *lens, 0.2, 3), windowed)
    assert not torch.equal(windowed, full)

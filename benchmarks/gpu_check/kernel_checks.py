"""Each triton kernel against its torch reference, compiled for the GPU (or, in the CPU smoke,
interpreted at tiny sizes).

The triton side runs through ``kernels``' public ops with the backend forced to "triton", so
the launch parameters are the ones the runtime uses. The reference runs on float64 copies of
the same inputs: the error measured is the kernel's own, not the reference's rounding. Attention
runs on paged KV laid out as the runtime lays it out (``tests/kernels/kv_cases.py``: shuffled
pages of 1 and 16 slots, every unused slot NaN, so a kernel that reads past a sequence fails),
with the grouped-query shapes of real models.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import arbor_kernels as kernels
import torch
from arbor_kernels import dispatch
from arbor_kernels.reference.sampling import filter_probs

from benchmarks.gpu_check.checks import (
    FAIL,
    PASS,
    SKIPPED,
    Check,
    Deadline,
    TensorError,
    error_check,
    tensor_error,
)
from tests.kernels.kv_cases import PagedBatch, paged_batch

# atol = rtol against the float64 reference. float32 attention takes three-pass tf32 dots
# (about float32's accuracy); bfloat16 rounds its output and softmax weights to 8 bits.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
Cases = list[tuple[str, TensorError]]


@dataclass(frozen=True)
class Sizes:
    """The shapes one run checks. attention_shapes: (name, query heads, KV heads, head dim)."""

    attention_shapes: tuple[tuple[str, int, int, int], ...]
    page_sizes: tuple[int, ...]
    decode_seq_lens: tuple[int, ...]
    extend_requests: tuple[tuple[int, int], ...]  # (prefix length, new tokens)
    tokens: int
    hidden_sizes: tuple[int, ...]
    intermediate_size: int
    vocab_size: int
    batch: int


GPU_SIZES = Sizes(
    attention_shapes=(("qwen2.5-0.5b", 14, 2, 64), ("llama-3-8b", 32, 8, 128)),
    page_sizes=(1, 16),
    decode_seq_lens=(1, 17, 300, 1024, 4096, 77),
    extend_requests=((0, 200), (1000, 1), (37, 300), (2000, 64), (15, 16), (0, 1)),
    tokens=300,
    hidden_sizes=(896, 4096),
    intermediate_size=4864,
    vocab_size=151936,
    batch=64,
)
SMOKE_SIZES = Sizes(
    attention_shapes=(("gqa-4-2", 4, 2, 32),),
    page_sizes=(1, 16),
    decode_seq_lens=(1, 19, 40),
    extend_requests=((0, 17), (13, 1), (5, 20)),
    tokens=5,
    hidden_sizes=(40,),
    intermediate_size=72,
    vocab_size=77,
    batch=6,
)


@contextmanager
def _backend(name: str) -> Iterator[None]:
    previous = kernels.kernel_backend()
    kernels.set_kernel_backend(name)
    try:
        yield
    finally:
        kernels.set_kernel_backend(previous)


def _triton(op: Callable[..., Any], *args: Any) -> Any:
    with _backend("triton"):
        return op(*args)


def _reference(op: Callable[..., Any], *args: Any) -> Any:
    """The torch reference of ``op`` on float64 copies of the floating-point arguments."""
    wide = [_float64(a) for a in args]
    with _backend("torch"):
        return op(*wide)


def _float64(arg: Any) -> Any:
    return arg.double() if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _paged(
    seq_lens: list[int], extend_lens: list[int], kv_heads: int, head_dim: int, page_size: int,
    dtype: torch.dtype, device: torch.device,
) -> PagedBatch:  # fmt: skip
    batch = paged_batch(seq_lens, extend_lens, kv_heads, head_dim, page_size, dtype, seed=page_size)
    return PagedBatch(*(getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)))


def _attention(
    op: Callable[..., torch.Tensor],
    seq_lens: list[int],
    extend_lens: list[int],
    sizes: Sizes,
    dtype: torch.dtype,
    device: torch.device,
) -> Cases:
    """``op`` (decode or extend attention) on paged batches of every shape and page size;
    extend attention also takes the new-token counts."""
    cases: Cases = []
    decode = op is kernels.decode_attention
    for name, heads, kv_heads, dim in sizes.attention_shapes:
        for page in sizes.page_sizes:
            b = _paged(seq_lens, extend_lens, kv_heads, dim, page, dtype, device)
            q = _randn(sum(extend_lens), heads, dim, dtype=dtype, device=device, seed=page)
            lens = (b.seq_lens,) if decode else (b.seq_lens, b.extend_lens)
            table = (b.req_to_token, b.req_pool_indices, *lens, dim**-0.5)
            out = _triton(op, q, b.k_buffer, b.v_buffer, *table)
            ref = b.finite()
            expected = _reference(op, q, ref.k_buffer, ref.v_buffer, *table)
            cases.append((f"{name} page {page}", tensor_error(out, expected, *_tol(dtype))))
    return cases


def _decode(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    seq_lens = list(sizes.decode_seq_lens)
    return _attention(kernels.decode_attention, seq_lens, [1] * len(seq_lens), sizes, dtype, device)


def _extend(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    seq_lens = [p + e for p, e in sizes.extend_requests]
    extend_lens = [e for _, e in sizes.extend_requests]
    return _attention(kernels.extend_attention, seq_lens, extend_lens, sizes, dtype, device)


def _rms_norm(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    cases: Cases = []
    for hidden in sizes.hidden_sizes:
        x = _randn(sizes.tokens, hidden, dtype=dtype, device=device, seed=0)
        weight = 1 + 0.1 * _randn(hidden, dtype=dtype, device=device, seed=1)
        out = _triton(kernels.rms_norm, x, weight, 1e-6)
        expected = _reference(kernels.rms_norm, x, weight, 1e-6)
        cases.append((f"hidden {hidden}", tensor_error(out, expected, *_tol(dtype))))
    return cases


def _fused_add_rms_norm(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    cases: Cases = []
    for hidden in sizes.hidden_sizes:
        x = _randn(sizes.tokens, hidden, dtype=dtype, device=device, seed=0)
        residual = _randn(sizes.tokens, hidden, dtype=dtype, device=device, seed=2)
        weight = 1 + 0.1 * _randn(hidden, dtype=dtype, device=device, seed=1)
        out, summed = _triton(kernels.fused_add_rms_norm, x, residual, weight, 1e-6)
        want, want_sum = _reference(kernels.fused_add_rms_norm, x, residual, weight, 1e-6)
        cases.append((f"hidden {hidden} out", tensor_error(out, want, *_tol(dtype))))
        cases.append((f"hidden {hidden} sum", tensor_error(summed, want_sum, *_tol(dtype))))
    return cases


def _rotary(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    cases: Cases = []
    tokens = sizes.tokens
    for name, heads, kv_heads, dim in sizes.attention_shapes:
        # q and k as the model makes them: views into one fused projection (strided rows).
        qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, seed=3)
        q = qkv[:, : heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        positions = torch.arange(tokens, device=device, dtype=torch.float32) + 1000
        inv_freq = 1e6 ** -(torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        angles = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)  # [T, D]
        q_out, k_out = _triton(kernels.apply_rotary_emb, q, k, emb.cos(), emb.sin())
        q_want, k_want = _reference(kernels.apply_rotary_emb, q, k, emb.cos(), emb.sin())
        cases.append((f"{name} q", tensor_error(q_out, q_want, *_tol(dtype))))
        cases.append((f"{name} k", tensor_error(k_out, k_want, *_tol(dtype))))
    return cases


def _silu_and_mul(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    x = _randn(sizes.tokens, 2 * sizes.intermediate_size, dtype=dtype, device=device, seed=4)
    out = _triton(kernels.silu_and_mul, x)
    expected = _reference(kernels.silu_and_mul, x)
    return [(f"intermediate {sizes.intermediate_size}", tensor_error(out, expected, *_tol(dtype)))]


def _bitmask(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    """Exact: the masked logits equal the reference's bit for bit, other rows untouched."""
    cases: Cases = []
    vocab, batch = sizes.vocab_size, sizes.batch
    gen = torch.Generator().manual_seed(5)
    full_words = -(-vocab // 32)
    for label, words, rows in [("every row", full_words, None), ("chosen rows", full_words, 3),
                               ("too few words", full_words - 1, 3)]:  # fmt: skip
        logits = _randn(batch, vocab, dtype=dtype, device=device, seed=6)
        count = batch if rows is None else rows
        bits = torch.randint(-(2**31), 2**31, (count, words), generator=gen, dtype=torch.int64)
        bitmask = bits.to(torch.int32).to(device)
        indices = None if rows is None else torch.randperm(batch, generator=gen)[:rows].to(device)
        expected = logits.clone()
        with _backend("torch"):
            kernels.apply_token_bitmask(expected, bitmask, indices)
        _triton(kernels.apply_token_bitmask, logits, bitmask, indices)
        cases.append((label, tensor_error(logits, expected, 0.0, 0.0)))
    return cases


def _sampling(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Cases:
    """Exact: each row keeps the reference's token set, and every draw is one of them.

    Rows are multiples of a power of two summing to exactly 1 (many ties), and the filter
    values are dyadic, so every sum and product is exact in float32 and the kept set has one
    right answer. The triton sampler draws from another random stream than the reference's:
    draws are checked for membership, not equality.
    """
    triton_sampling = importlib.import_module("arbor_kernels.triton_ops.sampling")
    vocab, batch = sizes.vocab_size, sizes.batch
    gen = torch.Generator().manual_seed(7)
    units = 1 << (8 * vocab - 1).bit_length()  # counts below 8 each never fill it
    counts = torch.randint(0, 8, (batch, vocab), generator=gen)
    counts[:, -1] = 0
    counts[:, -1] = units - counts.sum(-1)
    probs = (counts / units).float()[:, torch.randperm(vocab, generator=gen)].to(device)
    combos = [(k, p, m) for k in (0, 1, 5, 50, vocab) for p in (1.0, 0.75, 0.5, 0.25)
              for m in (0.0, 0.125, 0.5)]  # fmt: skip
    top_k, top_p, min_p = (
        torch.tensor([combos[b % len(combos)][i] for b in range(batch)], device=device)
        for i in range(3)
    )
    expected = filter_probs(probs, top_k, top_p.float(), min_p.float()) > 0
    with _backend("triton"):
        threshold = triton_sampling.keep_thresholds(probs, top_k, top_p, min_p)
    kept = (probs >= threshold[:, None]) & (probs > 0)
    seeds = torch.arange(batch, device=device) * 7919
    tokens = _triton(kernels.sample_from_probs, probs, top_k, top_p, min_p, seeds, seeds)
    drawn_kept = expected[torch.arange(batch, device=device), tokens].float()
    return [
        ("kept set", tensor_error(kept.float(), expected.float(), 0.0, 0.0)),
        ("draws in kept set", tensor_error(drawn_kept, torch.ones_like(drawn_kept), 0.0, 0.0)),
    ]


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCE[dtype], TOLERANCE[dtype]


@dataclass(frozen=True)
class KernelCheck:
    op: str
    run: Callable[[Sizes, torch.dtype, torch.device], Cases]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    exact: bool = False


KERNEL_CHECKS = (
    KernelCheck("decode_attention", _decode),
    KernelCheck("extend_attention", _extend),
    KernelCheck("rms_norm", _rms_norm),
    KernelCheck("fused_add_rms_norm", _fused_add_rms_norm),
    KernelCheck("apply_rotary_emb", _rotary),
    KernelCheck("silu_and_mul", _silu_and_mul),
    KernelCheck("apply_token_bitmask", _bitmask, exact=True),
    KernelCheck("sample_from_probs", _sampling, (torch.float32,), exact=True),
)


def verdict(name: str, cases: Cases, tolerance: float | None) -> Check:
    """One check from a kernel's cases: pass when every case is within tolerance (None: exact)."""
    worst = max(err.max_abs for _, err in cases)
    share = max(err.worst_share for _, err in cases)
    bad = [label for label, err in cases if not err.ok]
    if tolerance is None:
        limit = "exact"
    else:
        limit = f"{share:.2f} of the tolerance, atol=rtol={tolerance:g}"
    detail = f"max abs err {worst:.1e} ({limit}), {len(cases)} case{'s' if len(cases) > 1 else ''}"
    metrics = {
        "max_abs_err": worst,
        "worst_share_of_tolerance": share,
        "tolerance": tolerance,
        "cases": {label: dataclasses.asdict(err) for label, err in cases},
    }
    if bad:
        return Check(name, FAIL, f"{detail}; outside it: {', '.join(bad)}", metrics=metrics)
    return Check(name, PASS, detail, metrics=metrics)


def coverage_check() -> Check:
    """Every op with a registered triton implementation has a check here."""
    with_triton = sorted(op for op, impls in dispatch._impls.items() if "triton" in impls)
    unchecked = sorted(set(with_triton) - {c.op for c in KERNEL_CHECKS})
    if unchecked:
        return Check("every triton kernel checked", FAIL, f"no check for: {', '.join(unchecked)}")
    return Check("every triton kernel checked", PASS, f"{len(with_triton)} ops")


def run_kernel_checks(smoke: bool, deadline: Deadline) -> list[Check]:
    """All kernel checks on CUDA (or CPU under the interpreter for the smoke), one per kernel
    and dtype; a check that raises is reported and the others still run."""
    device = torch.device("cpu" if smoke else "cuda")
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    kernels.set_kernel_backend("triton")  # imports the triton kernels, raising if it cannot
    kernels.set_kernel_backend("auto")
    checks = [coverage_check()]
    for kernel_check in KERNEL_CHECKS:
        for dtype in kernel_check.dtypes:
            name = f"{kernel_check.op} {str(dtype).removeprefix('torch.')}"
            if deadline.left() < 5:
                checks.append(Check(name, SKIPPED, "out of time", gating=False))
                continue
            try:
                cases = kernel_check.run(sizes, dtype, device)
                tolerance = None if kernel_check.exact else TOLERANCE[dtype]
                checks.append(verdict(name, cases, tolerance))
            except Exception as exc:  # reported; the other kernels still run
                checks.append(error_check(name, exc))
    return checks

"""The dispatch point: CUDA tensors get triton under "auto", CPU tensors the torch reference;
a forced backend wins; a missing triton never breaks the CPU path."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels import dispatch
from arbor_kernels.reference import attention as reference

from tests.kernels.kv_cases import assert_close, paged_batch

REPO = Path(__file__).resolve().parents[2]
OPS = [
    "extend_attention",
    "decode_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rotary_emb",
    "silu_and_mul",
    "apply_token_bitmask",
    "sample_from_probs",
]


@pytest.fixture
def restore_backend() -> Iterator[None]:
    previous = kernels.kernel_backend()
    yield
    kernels.set_kernel_backend(previous)


def _backend_of(op: str, device: str) -> str:
    """The backend whose implementation of ``op`` runs for tensors on ``device`` now."""
    impl = dispatch.resolve(op, torch.device(device))
    return next(backend for backend, fn in dispatch._impls[op].items() if fn is impl)


def test_every_op_has_a_triton_kernel(triton_ops: ModuleType) -> None:
    for op in OPS:
        assert dispatch._impls[op]["triton"].__module__.startswith("arbor_kernels.triton_ops."), op


NATIVE_OPS = {"extend_attention", "decode_attention", "rms_norm", "fused_add_rms_norm",
              "apply_rotary_emb", "silu_and_mul", "apply_token_bitmask"}  # fmt: skip


def test_auto_picks_triton_for_cuda_and_native_or_torch_for_cpu(
    triton_ops: ModuleType, restore_backend: None
) -> None:
    kernels.set_kernel_backend("auto")
    assert kernels.native_available(), (
        "run `python -m arbor_kernels.cpu_native` (make install does)"
    )
    for op in OPS:
        assert _backend_of(op, "cpu") == ("native" if op in NATIVE_OPS else "torch"), op
        assert _backend_of(op, "cuda") == "triton", op


def test_forced_torch_keeps_the_reference_on_cpu(restore_backend: None) -> None:
    kernels.set_kernel_backend("torch")
    assert all(_backend_of(op, "cpu") == "torch" for op in OPS)
    kernels.set_kernel_backend("native")
    for op in OPS:
        assert _backend_of(op, "cpu") == ("native" if op in NATIVE_OPS else "torch"), op


def test_an_op_follows_a_backend_switch_after_it_has_run(
    restore_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The op remembers what it resolved to; switching backends or registering must forget it.
    calls: list[str] = []
    for backend in ("torch", "native"):
        impl = dispatch._impls["silu_and_mul"].get(backend)
        if impl is not None:
            counting = (lambda b, f: lambda x: calls.append(b) or f(x))(backend, impl)
            monkeypatch.setitem(dispatch._impls["silu_and_mul"], backend, counting)
    dispatch._resolved.clear()
    x = torch.randn(2, 8)
    kernels.set_kernel_backend("torch")
    kernels.silu_and_mul(x)
    kernels.silu_and_mul(x)
    assert calls == ["torch", "torch"]
    kernels.set_kernel_backend("native")
    kernels.silu_and_mul(x)
    assert calls[-1] == "native"
    dispatch.register("silu_and_mul", "native")(lambda x: calls.append("new") or x)
    try:
        kernels.silu_and_mul(x)
        assert calls[-1] == "new"
    finally:
        monkeypatch.undo()
        dispatch._resolved.clear()


def test_forced_backends_win_over_the_device(triton_ops: ModuleType, restore_backend: None) -> None:
    kernels.set_kernel_backend("torch")
    assert all(_backend_of(op, "cuda") == "torch" for op in OPS)
    kernels.set_kernel_backend("triton")
    assert all(_backend_of(op, "cpu") == "triton" for op in OPS)


DECODE_FORWARD_OPS = ["decode_attention", "rms_norm", "fused_add_rms_norm", "apply_rotary_emb",
                      "silu_and_mul"]  # fmt: skip


def test_graph_safe_follows_the_implementation_picked(
    triton_ops: ModuleType, restore_backend: None
) -> None:
    cuda = torch.device("cuda")
    kernels.set_kernel_backend("auto")
    assert all(kernels.graph_safe(op, cuda) for op in DECODE_FORWARD_OPS)
    kernels.set_kernel_backend("torch")
    # The reference decode attention loops over seq_lens.tolist(): not capturable.
    assert not kernels.graph_safe("decode_attention", cuda)
    assert kernels.graph_safe("rms_norm", cuda)  # plain tensor ops
    assert not kernels.graph_safe("extend_attention", torch.device("cpu"))


def test_forced_triton_runs_the_kernel_through_the_op(
    triton_ops: ModuleType, restore_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = paged_batch([9, 20], [9, 4], 2, 16, 16, torch.float32)
    q = torch.randn(13, 4, 16)
    args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, 0.25)
    launches: list[tuple[int, ...]] = []
    kernel = triton_ops.extend_attention._extend_attention_kernel
    monkeypatch.setattr(
        triton_ops.extend_attention,
        "_extend_attention_kernel",
        _CountingKernel(kernel, launches),
    )
    kernels.set_kernel_backend("triton")
    out = kernels.extend_attention(q, batch.k_buffer, batch.v_buffer, *args)
    assert len(launches) == 1
    ref = batch.finite()
    expected = reference.extend_attention(q, ref.k_buffer, ref.v_buffer, *args)
    assert_close(out, expected, torch.float32)


class _CountingKernel:
    """Stands in for a triton kernel: records each launch's grid, then launches."""

    def __init__(self, kernel: object, launches: list[tuple[int, ...]]) -> None:
        self._kernel = kernel
        self._launches = launches

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self._launches.append(grid)
        return self._kernel[grid]  # type: ignore[index]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_environment_variable_sets_the_starting_backend() -> None:
    result = _python(
        "import arbor_kernels as k; print(k.kernel_backend())", ARBOR_KERNEL_BACKEND="torch"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch"
    bad = _python("import arbor_kernels", ARBOR_KERNEL_BACKEND="cuda")
    assert bad.returncode != 0
    assert "ARBOR_KERNEL_BACKEND='cuda' is not a kernel backend" in bad.stderr


def test_cpu_path_survives_a_missing_triton() -> None:
    code = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
import arbor_kernels as kernels
from arbor_kernels import dispatch
x = torch.randn(2, 8)
out = kernels.rms_norm(x, torch.ones(8), 1e-6)
assert out.shape == (2, 8)
resolved = dispatch.resolve("rms_norm", torch.device("cuda"))
assert resolved.__module__.startswith("arbor_kernels.reference")
try:
    kernels.set_kernel_backend("triton")
except RuntimeError as exc:
    print("refused:", exc)
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "refused: kernel backend 'triton' requested but unavailable" in result.stdout


def test_server_args_offer_exactly_the_kernel_backends() -> None:
    from runtime.server_args import KERNEL_BACKENDS, ServerArgs

    assert KERNEL_BACKENDS == kernels.BACKENDS
    with pytest.raises(ValueError, match="kernel_backend must be one of auto, torch, triton"):
        ServerArgs(model_path="m", kernel_backend="cuda")

"""The triton RMSNorm, fused add + RMSNorm, RoPE and SiLU-and-mul equal the torch references."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from arbor_kernels.reference import elementwise as reference

from tests.kernels.kv_cases import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 40])
def test_rms_norm(triton_ops: ModuleType, dtype: torch.dtype, hidden: int) -> None:
    x = _randn(3, 5, hidden, dtype=dtype)
    weight = _randn(hidden, dtype=dtype, seed=1)
    out = triton_ops.norm.rms_norm(x, weight, 1e-6)
    expected = reference.rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert_close(out, expected, dtype)


def test_rms_norm_with_a_float32_weight_returns_float32(triton_ops: ModuleType) -> None:
    x = _randn(4, 48, dtype=torch.bfloat16)
    weight = _randn(48, seed=1)
    out = triton_ops.norm.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    assert_close(out, reference.rms_norm(x, weight, 1e-5), x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(triton_ops: ModuleType, dtype: torch.dtype) -> None:
    x, residual = _randn(6, 40, dtype=dtype), _randn(6, 40, dtype=dtype, seed=1)
    weight = _randn(40, dtype=dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = triton_ops.norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(summed, expected_sum, dtype)
    assert_close(out, expected, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (7, 1, 24), (8, 2, 32)])
def test_rotary(
    triton_ops: ModuleType, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    tokens = 5
    # q and k as the model makes them: views into one fused projection (strided rows).
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.arange(tokens)[:, None] * _randn(head_dim // 2, seed=1).abs()[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    q_out, k_out = triton_ops.rotary.apply_rotary_emb(q, k, emb.cos(), emb.sin())
    q_expected, k_expected = reference.apply_rotary_emb(q, k, emb.cos(), emb.sin())
    assert_close(q_out, q_expected, dtype)
    assert_close(k_out, k_expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(triton_ops: ModuleType, dtype: torch.dtype) -> None:
    x = _randn(2, 3, 2 * 72, dtype=dtype)
    out = triton_ops.activation.silu_and_mul(x, block=32)
    expected = reference.silu_and_mul(x)
    assert out.shape == (2, 3, 72)
    assert_close(out, expected, dtype)

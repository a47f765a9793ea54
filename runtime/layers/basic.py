"""Linear and RMSNorm modules whose parameters the weight loader fills in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import arbor_kernels as kernels
import torch
import torch.nn.functional as F

from runtime.cpu_features import cpu_flags, has_bf16_dot
from runtime.distributed.partition import Shard


def onednn_packing_available(weight: torch.Tensor, flags: frozenset[str] | None = None) -> bool:
    """Whether ``pack_weight`` applies: on CPU with oneDNN (mkldnn) in this torch, float32, or
    bfloat16 where the CPU (``flags``; default: this machine's) has bfloat16 dot products —
    without them oneDNN's bfloat16 GEMMs are slower than float32 ones (runtime/cpu_features.py),
    and the weight stays with ``F.linear``."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and has_bf16_dot(cpu_flags() if flags is None else flags)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (float32 or bfloat16) reordered into oneDNN's blocked layout for
    ``packed_linear``.

    float32, measured on the 2-core VMs: 2.5-3x faster than ``F.linear`` (MKL) at 32-2048 rows
    and up to 6x for a wide output at one row (docs/kernels.md); results differ by float32
    rounding. bfloat16 (AVX512-BF16): products of bfloat16 summed in float32, the output
    rounded to bfloat16 once; reading half the bytes, it ran 1.9-6x faster than packed float32
    on SmolLM2's larger shapes at 1-32 rows, and 3.5-7x at 512 (docs/benchmarks.md).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [N, in] times a ``pack_weight`` result, in (and returning) the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# A checkpoint tensor as the loader hands it over: a torch.Tensor, or a safetensors slice whose
# bytes are read only when it is indexed (a tensor-parallel rank reads just its shard).
CheckpointTensor = Any
# A weight dimension: an int is held whole, a Shard in part (runtime/distributed/partition.py).
Dim = int | Shard


def checkpoint_shape(source: CheckpointTensor) -> tuple[int, ...]:
    shape = source.get_shape() if hasattr(source, "get_shape") else source.shape
    return tuple(int(n) for n in shape)


def read_shard(
    source: CheckpointTensor,
    name: str,
    expected: tuple[int, ...],
    rows: Shard | None = None,
    cols: Shard | None = None,
) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` (whose shape must be ``expected``, else a
    ValueError naming both) in ``rows`` of dimension 0 and ``cols`` of dimension 1 (None:
    all); a shard running past the tensor's end gives fewer rows than its size."""
    shape = checkpoint_shape(source)
    if shape != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {expected}")
    if rows is None:
        return source[:]
    row_part = slice(rows.start, rows.start + rows.stored)
    if cols is None:
        return source[row_part]
    return source[row_part, cols.start : cols.start + cols.stored]


def fill(target: torch.Tensor, data: torch.Tensor) -> None:
    """Copy ``data`` into the first rows of ``target``; zero the rest (a padded shard)."""
    rows = data.shape[0]
    target[:rows].copy_(data)
    target[rows:].zero_()


def _as_shard(dim: Dim) -> Shard:
    return dim if isinstance(dim, Shard) else Shard.whole(dim)


class Linear(torch.nn.Module):
    """y = x W^T (+ b) over the part of W this rank holds. ``out_features`` may stack several
    checkpoint tensors (q|k|v, gate|up), whose row ranges ``shard_offsets`` names for the
    loader. An int dimension is held whole; a ``Shard`` dimension in part, which is how the
    tensor-parallel layers (runtime/layers/parallel.py) split W. After ``pack()`` (CPU: float32,
    or bfloat16 with AVX512-BF16) the weight lives only in oneDNN's layout and ``weight`` is an
    empty placeholder."""

    def __init__(
        self,
        in_features: Dim,
        out_features: Dim | Mapping[str, Dim],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        pieces = out_features if isinstance(out_features, Mapping) else {"": out_features}
        self.in_shard = _as_shard(in_features)
        self.out_shards = {name: _as_shard(dim) for name, dim in pieces.items()}
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shard in self.out_shards.items():
            self.shard_offsets[name] = (offset, shard.size)
            offset += shard.size
        self.weight = torch.nn.Parameter(
            torch.empty(offset, self.in_shard.size, dtype=dtype), False
        )
        self.bias = torch.nn.Parameter(torch.empty(offset, dtype=dtype), False) if bias else None
        self.packed: torch.Tensor | None = None

    def load(self, kind: str, piece: str, source: CheckpointTensor, name: str) -> None:
        """Fill this rank's part of stacked piece ``piece`` of the ``weight`` or ``bias`` from
        the whole checkpoint tensor ``source`` (named ``name`` in errors)."""
        offset, size = self.shard_offsets[piece]
        out = self.out_shards[piece]
        if kind == "weight":
            expected = (out.full, self.in_shard.full)
            data = read_shard(source, name, expected, out, self.in_shard)
            fill(self.weight.data[offset : offset + size], data)
        else:
            assert kind == "bias" and self.bias is not None
            fill(self.bias.data[offset : offset + size], read_shard(source, name, (out.full,), out))

    def pack(self) -> None:
        """Move the (loaded) weight into oneDNN's layout, when that applies; frees the plain copy
        so the weights are not held twice."""
        if self.packed is None and onednn_packing_available(self.weight):
            self.packed = pack_weight(self.weight)
            self.weight = torch.nn.Parameter(self.weight.new_empty(0), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if kernels.deterministic():
            return kernels.fixed_order_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(dim, dtype=dtype), False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: rms_norm(x). With it: (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

"""The float linear layer of deterministic mode (``dispatch.set_deterministic``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from arbor_kernels.dispatch import register


@register("fixed_order_linear", "torch")
def fixed_order_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x W^T (+ bias), x [..., k], W [n, k], y in x's dtype, each output row computed in
    an order that does not depend on how many rows x has (here: one row at a time; the native
    kernel sums every output in one fixed order)."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.cat([F.linear(row, weight, bias) for row in rows.split(1)]) if len(rows) else None
    if y is None:
        y = rows.new_empty(0, weight.shape[0])
    return y.view(*x.shape[:-1], weight.shape[0])

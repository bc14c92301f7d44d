"""A LoRA that only chosen token rows see: the span adapter served to requests under span attention alone.

Merged into the weights, the adapter moves every request, and dense ones lose answers it was never needed for (the
shipped adapter cost them 1.9 points). Kept apart, each targeted linear adds B(Ax) on the rows of requests whose
prompt keeps a span (`ForwardBatch.span_adapter_rows`), and every other row runs on the base weights, bit for bit.
The cost is two thin matmuls per linear on every row of a batch that has such a row, and of every CUDA-graph replay
(rank 16 over a 896-wide layer: a few percent of its FLOPs); the switch is a multiply, so shapes stay static and
graphs capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AdapterRows:
    """The batch's per-row switch of the adapter, [T, 1] in the model's dtype, which the model sets from its
    ForwardBatch before its layers run; every RowLora of the model reads this one holder. None: no row of the batch
    runs under the adapter, and its layers skip it (an eager batch of dense requests pays nothing; a CUDA graph is
    captured with it and pays on every replay)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.mask: torch.Tensor | None = None

    def set(self, rows: torch.Tensor, active: bool) -> None:
        self.mask = rows.to(self.dtype).unsqueeze(-1) if active else None


class RowLora(nn.Module):
    """B(Ax) on the rows the holder switches on, nothing elsewhere. `a` [r, in] and `b` [out, r] are this rank's
    slices (the scale folded into b), so a row-parallel layer adds its partial before the ranks' sum."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, rows: AdapterRows) -> None:
        super().__init__()
        # Buffers, not parameters: a weight update from a checkpoint neither expects nor touches them.
        self.register_buffer("a", a.contiguous(), persistent=False)
        self.register_buffer("b", b.contiguous(), persistent=False)
        self.rows = rows

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + B(Ax) on the rows the holder switches on: the mask scales the rank-wide product, and the add rides
        in B's matmul (three kernels a linear)."""
        if self.rows.mask is None:
            return out
        return torch.addmm(out, F.linear(x, self.a) * self.rows.mask, self.b.t())

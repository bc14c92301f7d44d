"""A LoRA that only chosen token rows see: the span adapter served to requests under span attention alone.

Merged into the weights, the adapter moves every request, and dense ones lose answers it was never needed for (the
shipped adapter cost them 1.9 points). Kept apart, each targeted linear adds B(Ax) on the rows of requests whose
prompt keeps a span (`ForwardBatch.span_adapter_rows`), and every other row runs on the base weights.

It rides in the linear's own GEMM: the input gains r columns, the switched down-projection m * (x A^T), and the weight
gains B as r more columns, so y = [x | m x A^T] [W | B]^T. The layer's weight is a view of [W | B]'s first columns,
so batches without such a row read the same bytes through it. The switch is a multiply, so shapes stay static and
CUDA graphs capture it. Added after the GEMM instead (x A^T, then B's product into y), the adapter cost 14% of a RAG
run's throughput on an H100, mostly in passes over y, which is up to 7x as wide as x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AdapterRows:
    """The batch's per-row switch of the adapter, [T] in the model's dtype, which the model sets from its
    ForwardBatch before its layers run; every RowLora of the model reads this one holder. None: no row of the batch
    runs under the adapter, and its layers skip it, so a batch of dense requests pays nothing (CUDA graphs are
    captured with and without the switch, model_executor/cuda_graph_runner.py)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.on: torch.Tensor | None = None

    def set(self, rows: torch.Tensor, active: bool) -> None:
        self.on = rows.to(self.dtype) if active else None


class RowLora(nn.Module):
    """B(Ax) on the rows the holder switches on, nothing elsewhere, for one linear whose `weight` [out, in] it takes
    over: `a` [r, in] and `b` [out, r] are this rank's slices (the scale folded into b), so a row-parallel layer adds
    its partial before the ranks' sum. The rank is padded with zeros to a power of two of at least 16 (the Triton
    kernel's tile), which adds nothing to the product."""

    def __init__(self, weight: nn.Parameter, a: torch.Tensor, b: torch.Tensor, rows: AdapterRows) -> None:
        super().__init__()
        rank = max(16, 1 << (a.shape[0] - 1).bit_length())
        pad = rank - a.shape[0]
        joined = torch.cat([weight.data, F.pad(b, (0, pad)).to(weight)], dim=1)
        weight.data = joined[:, : weight.shape[1]]  # the layer's weight now lives in the joined one
        # Buffers, not parameters: a weight update from a checkpoint neither expects nor touches them.
        self.register_buffer("a", F.pad(a, (0, 0, 0, pad)).to(weight).contiguous(), persistent=False)
        self.register_buffer("joined", joined, persistent=False)
        self.rows = rows

    def operands(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The GEMM's input and weight for x [T, in]: (x, weight) when no row of the batch is switched on, else the
        joined pair. On CUDA two Triton kernels build the joined input (kernels/row_lora.py); elsewhere these torch
        ops."""
        on = self.rows.on
        if on is None:
            return x, weight
        if x.is_cuda:
            from sglang_pic.kernels.row_lora import shrink_cat

            return shrink_cat(x, self.a, on), self.joined
        return torch.cat([x, F.linear(x, self.a) * on[:, None]], dim=-1), self.joined

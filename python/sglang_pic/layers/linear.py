"""Linear layers whose weights always come from a checkpoint or a seeded dummy init, never from nn.Linear's init.

Skipping the kaiming init matters: it costs seconds for a 0.5B model on CPU, only to be overwritten.
Under tensor parallelism (tp_size > 1) each rank holds a slice: `MergedColumnParallelLinear` splits output rows
(several HF projections, q|k|v or gate|up, stay packed in one matmul: each packed part is split on its own), and
`RowParallelLinear` splits input columns and sums the ranks' partial outputs. At tp_size 1 both are plain linears.
Each layer's `weight_loader` copies its slice out of a full checkpoint tensor.

With `quant="fp8"` a layer holds its weight in float8_e4m3fn and `weight_scale`, one float32 scale per output row of
the full checkpoint tensor (layers/quant_fp8.py): a column-parallel rank takes its rows' scales, a row-parallel rank
its column slice under the whole row's scale, so every tp size serves the same weights (as an fp8 checkpoint's
scales, computed over whole rows, require). Activations are quantized per token inside the forward, over what each
rank holds: a row-parallel rank scales its slice of the input, which needs no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_pic.distributed.parallel_state import all_reduce, get_tp_group
from sglang_pic.distributed.sharding import Shard, even_shard, kv_head_shard
from sglang_pic.layers.quant_fp8 import FP8, Fp8Rows, channel_scales, fp8_linear
from sglang_pic.layers.row_lora import RowLora
from sglang_pic.quant_config import check_quantization


class Linear(nn.Linear):
    """`quant`: None (weights in the model's dtype) or fp8 (an fp8 weight and its per-row `weight_scale`).
    `lora`: a span adapter kept apart from the weights (layers/row_lora.py), in this rank's product."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        check_quantization(quant)
        self.quant = quant
        self.lora: RowLora | None = None
        if quant is None:
            self.register_parameter("weight_scale", None)
            return
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=self.weight.device), requires_grad=False
        )

    def reset_parameters(self) -> None:
        """Leave the parameters uninitialized; the loader fills every one of them."""

    def matmul(self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        """x, or activations an fp8 layer's producer already quantized (Fp8Rows), times the weight."""
        if self.quant is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        if self.lora is None:
            return F.linear(x, self.weight, bias)
        return F.linear(*self.lora.operands(x, self.weight), bias)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(Linear):
    """Packed projections; `parts` maps each HF projection to the rows of its full tensor this rank holds."""

    def __init__(
        self, in_features: int, parts: dict[str, Shard], bias: bool = False, quant: str | None = None
    ) -> None:
        super().__init__(in_features, sum(p.size for p in parts.values()), bias=bias, quant=quant)
        self.parts = parts
        self.offsets: dict[str, int] = {}  # where each part starts in this rank's packed rows
        start = 0
        for name, part in parts.items():
            self.offsets[name] = start
            start += part.size

    @classmethod
    def split_evenly(
        cls, in_features: int, output_sizes: dict[str, int], bias: bool = False, quant: str | None = None
    ) -> "MergedColumnParallelLinear":
        tp = get_tp_group()
        parts = {name: even_shard(n, tp.rank, tp.size, f"{name} size") for name, n in output_sizes.items()}
        return cls(in_features, parts, bias, quant)

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(self.parts)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        """Copy this rank's rows of the HF tensor of projection `shard` (weight, bias, weight_scale, or a span
        adapter's B factor) into its packed rows of `param`."""
        part = self.parts[shard]
        if param is self.weight_scale:
            loaded = channel_scales(loaded, part.full)
        if loaded.shape[0] != part.full or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard!r} has shape {tuple(loaded.shape)}, expected ({part.full}, ...)")
        start = self.offsets[shard]
        with torch.no_grad():
            param[start : start + part.size].copy_(loaded[part.start : part.start + part.size])


class QKVParallelLinear(MergedColumnParallelLinear):
    """q|k|v split by heads: each rank holds num_heads / tp query heads and the KV heads they attend to."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
        quant: str | None = None,
    ) -> None:
        tp = get_tp_group()
        q = even_shard(num_heads, tp.rank, tp.size, "num_attention_heads")
        kv = kv_head_shard(num_kv_heads, tp.rank, tp.size)

        def rows(heads: Shard) -> Shard:
            return Shard(heads.full * head_dim, heads.start * head_dim, heads.size * head_dim)

        super().__init__(hidden_size, {"q": rows(q), "k": rows(kv), "v": rows(kv)}, bias, quant)


class RowParallelLinear(Linear):
    """Input features split across ranks; the partial outputs are summed over the ranks, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: str | None = None) -> None:
        tp = get_tp_group()
        self.tp_size = tp.size
        self.in_shard = even_shard(in_features, tp.rank, tp.size, "input size of a row-parallel layer")
        super().__init__(self.in_shard.size, out_features, bias=bias, quant=quant)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        """The bias and weight_scale whole (they are per output row), the weight's columns of this rank."""
        if param is self.weight_scale:
            loaded = channel_scales(loaded, self.out_features)
        if param is not self.weight:
            expected = tuple(param.shape)
            piece = loaded
        else:
            expected = (self.out_features, self.in_shard.full)
            piece = self.input_slice(loaded)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != {expected}")
        with torch.no_grad():
            param.copy_(piece)

    def input_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a tensor over the layer's whole input."""
        return full[:, self.in_shard.start : self.in_shard.start + self.in_shard.size]

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        out = all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


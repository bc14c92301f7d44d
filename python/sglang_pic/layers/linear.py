"""Linear layers whose weights always come from a checkpoint or a seeded dummy init, never from nn.Linear's init.

Skipping the kaiming init matters: it costs seconds for a 0.5B model on CPU, only to be overwritten.
`MergedLinear` stacks several HF projections (q|k|v, gate|up) into one matmul.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """Leave the parameters uninitialized; the loader fills every one of them."""


class MergedLinear(Linear):
    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias=bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for shard, size in output_sizes.items():
            self.offsets[shard] = (start, size)
            start += size

    def load_shard(self, param: torch.Tensor, shard: str, loaded: torch.Tensor) -> None:
        """Copy the HF tensor of projection `shard` (weight or bias) into its rows of `param`."""
        start, size = self.offsets[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard!r} has shape {tuple(loaded.shape)}, expected ({size}, ...)")
        with torch.no_grad():
            param[start : start + size].copy_(loaded)

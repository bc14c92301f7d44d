"""Gated MLP activations over a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedAct(nn.Module):
    """act(gate) * up where x = [gate | up] along the last dim, as produced by `gate_up_proj`."""

    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        if act not in _ACTS:
            raise NotImplementedError(f"unsupported hidden_act {act!r}")
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

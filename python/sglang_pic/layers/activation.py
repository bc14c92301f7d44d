"""Gated MLP activations over a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_pic.layers.quant_fp8 import MIN_AMAX, Fp8Rows, quantizes_activations

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedAct(nn.Module):
    """act(gate) * up where x = [gate | up] along the last dim, as produced by `gate_up_proj`. SiLU on CUDA is one
    Triton kernel (kernels/norm_act.py); elsewhere, and for the other activations, these torch ops (its reference).
    `fp8_out`: the output feeds only an fp8 linear, so on CUDA the SiLU kernel quantizes it per token when that
    linear would (Fp8Rows)."""

    def __init__(self, act: str = "silu", fp8_out: bool = False) -> None:
        super().__init__()
        if act not in _ACTS:
            raise NotImplementedError(f"unsupported hidden_act {act!r}")
        self.act_name = act
        self.act = _ACTS[act]
        self.fp8_out = fp8_out

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Rows:
        if x.is_cuda and self.act_name == "silu":
            from sglang_pic.kernels.norm_act import silu_and_mul, silu_and_mul_fp8

            if self.fp8_out and quantizes_activations(x.numel() // x.shape[-1], x.dtype):
                return Fp8Rows(*silu_and_mul_fp8(x, MIN_AMAX), x.dtype)
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

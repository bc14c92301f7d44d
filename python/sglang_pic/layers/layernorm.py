"""RMSNorm with an optional fused residual add, computed in float32 like the HF reference."""

from __future__ import annotations

import torch
from torch import nn

from sglang_pic.layers.quant_fp8 import MIN_AMAX, Fp8Rows, quantizes_activations


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, fp8_out: bool = False) -> None:
        """`fp8_out`: the output feeds only an fp8 linear, so on CUDA the kernel quantizes it per token when that
        linear would (Fp8Rows), sparing the quantization kernel's launch."""
        super().__init__()
        self.eps = eps
        self.fp8_out = fp8_out
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Rows | tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the pre-norm block pattern.
        On CUDA one Triton kernel (kernels/norm_act.py); elsewhere these torch ops, its reference."""
        if x.is_cuda:
            from sglang_pic.kernels.norm_act import rms_norm, rms_norm_fp8

            dtype = torch.result_type(self.weight, x)
            if self.fp8_out and quantizes_activations(x.numel() // x.shape[-1], dtype):
                values, scales, summed = rms_norm_fp8(x, self.weight, self.eps, residual, MIN_AMAX)
                out = Fp8Rows(values, scales, dtype)
            else:
                out, summed = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

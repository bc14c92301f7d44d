"""LoRA layers for training: every targeted nn.Linear of an HF model gets trainable factors A [r, in] and B [out, r]
(B starts at zero, so the student starts as the teacher), and the same model with the factors switched off is the
teacher: one copy of the base weights serves both."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from sglang_pic.model_loader.span_adapter import SpanAdapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.enabled = True
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.enabled:
            return out
        low = (x.to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()
        return out + (self.scale * low).to(out.dtype)


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = TARGETS) -> dict[str, LoRALinear]:
    """Wrap every targeted linear layer of the model's decoder (never the LM head); freeze everything else. Returns
    the wrappers by HF module name."""
    model.requires_grad_(False)
    wrapped = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha)
                setattr(module, child_name, lora)
                wrapped[f"{name}.{child_name}" if name else child_name] = lora
    if not wrapped:
        raise ValueError(f"the model has no linear layers named {', '.join(targets)}")
    return wrapped


@contextlib.contextmanager
def lora_off(layers: dict[str, LoRALinear]) -> Iterator[None]:
    """The base model (the teacher) inside the block."""
    for layer in layers.values():
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers.values():
            layer.enabled = True


def to_adapter(layers: dict[str, LoRALinear], rank: int, alpha: float, record: dict,
               dtype: torch.dtype = torch.float32) -> SpanAdapter:
    """The trained factors as an adapter, stored in `dtype` (bfloat16 halves the files; the merge adds in float32)."""
    factors = {name: (l.lora_A.detach().to("cpu", dtype), l.lora_B.detach().to("cpu", dtype))
               for name, l in layers.items()}
    return SpanAdapter(rank, alpha, factors, record)

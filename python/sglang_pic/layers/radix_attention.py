"""The attention layer models call: it forwards unrotated q, k, v to the batch's attention backend (and, in a probe
pass, lets the probe score the question's attention: layers/attention_probe.py; in a deviation pass, the new KV's
distance from the shared span KV: layers/deviation_probe.py)."""

from __future__ import annotations

import torch
from torch import nn

from sglang_pic.forward_batch import ForwardBatch
from sglang_pic.layers.rotary_embedding import RotaryEmbedding


class RadixAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        rotary: RotaryEmbedding,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.rotary = rotary

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        out = forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
        if forward_batch.probe is not None:
            forward_batch.probe.score(q, self, forward_batch)
        if forward_batch.deviation is not None:
            forward_batch.deviation.score(k, v, self, forward_batch)
        return out

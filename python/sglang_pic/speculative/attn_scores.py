"""Attention scores for score-based compressors, measured during an observation forward.

The engine's kernels never materialize attention probabilities, so this backend wrapper recomputes them in torch
for the observed queries: after the wrapped backend has run a layer, it rotates those queries and the stored
(unrotated) keys they see with RoPE and sums softmax(q k^T) per key. It reads keys through whatever pool and token
table the batch carries, so it works on the device pool and on host-tier staging buffers alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_pic.kernels.torch_native import rope_rotate
from sglang_pic.layers.attention_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention


class ScoreCapture(AttentionBackend):
    """scores[b] [layers, Hkv, n_b]: attention each key of request b received from its observed queries.

    Every new token of the batch is an observed query; request b's keys are [0, seq_lens[b]).
    """

    def __init__(self, inner: AttentionBackend, num_layers: int) -> None:
        self.inner = inner
        self.num_layers = num_layers
        self.scores: list[torch.Tensor] = []

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        out = self.inner.forward(q, k, v, layer, forward_batch)
        self._accumulate(q.view(-1, layer.num_heads, layer.head_dim), layer, forward_batch)
        return out

    def _accumulate(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> None:
        k_buf = fb.token_to_kv_pool.get_key_buffer(layer.layer_id)
        table = fb.req_to_token_pool.req_to_token
        cos_sin = layer.rotary.cos_sin_cache
        hkv = layer.num_kv_heads
        group = layer.num_heads // hkv
        if not self.scores:
            self.scores = [
                torch.zeros((self.num_layers, hkv, n), dtype=torch.float32, device=q.device) for n in fb.seq_lens_cpu
            ]
        starts = fb.extend_start_loc.tolist()
        for b, (start, count, n) in enumerate(zip(starts, fb.extend_seq_lens_cpu, fb.seq_lens_cpu)):
            rows = slice(start, start + count)
            pos = fb.positions[rows]
            query = rope_rotate(q[rows], pos, cos_sin).view(count, hkv, group, -1)
            key_idx = torch.arange(n, device=q.device)
            keys = rope_rotate(k_buf[table[fb.req_pool_indices[b], :n]], key_idx, cos_sin)
            visible = (key_idx[None, :] <= pos[:, None]) & (key_idx[None, :] >= fb.attn_lo[rows][:, None])
            for h in range(hkv):  # one KV head at a time bounds the [count, group, n] probabilities
                logits = torch.einsum("cgd,nd->cgn", query[:, h], keys[:, h]) * layer.scaling
                logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
                self.scores[b][layer.layer_id, h] += torch.softmax(logits, dim=-1).sum(dim=(0, 1))

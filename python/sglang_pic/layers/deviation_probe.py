"""The deviation pass's scores: how far a span token's KV with full attention is from the shared copy it reuses.

A deviation pass (managers/span_deviation.py) computes a request's whole prompt with full attention through its
first layers only, into throwaway slots of a scratch row. At its last layer the keys and values it just computed
for the request's reused span positions are compared with the shared copy those positions read (the slots of the
request's own row): each position's score is the squared distance of its key and of its value, each relative to
the shared vector's squared norm, summed over the layer's kv heads. Keys are stored unrotated, so the two compare
directly whatever offset the span was prefilled at. Under tensor parallelism each rank scores its own heads and
`finish` sums the ranks' scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang_pic.kv_cache_dtype import to_kv_dtype

EPS = 1e-12  # a zero shared vector (padding) never divides by zero


@dataclass
class DeviationProbe:
    """One request's deviation pass: its new-token rows are prompt positions 0.., and `positions` of them are
    compared with the shared `slots` they read, at layer `layer` (the pass's last: the batch stops there). The
    slots travel with the probe: a follower rank has not seen the request's row yet."""

    layer: int
    positions: list[int]
    slots: list[int]
    scores: torch.Tensor  # [prompt_len] float32 on the device

    def to_list(self) -> list[int]:
        return [self.layer, self.scores.numel(), *self.positions, *self.slots]

    @classmethod
    def from_list(cls, values: list[int], device: torch.device) -> DeviationProbe:
        """A follower's probe for rank 0's (its own scores, which `finish` sums into rank 0's)."""
        layer, length, *rest = values
        n = len(rest) // 2
        return cls(layer, rest[:n], rest[n:], torch.zeros(length, dtype=torch.float32, device=device))

    def score(self, k: torch.Tensor, v: torch.Tensor, layer, forward_batch) -> None:
        """At the probe's layer: add each compared position's deviation (k, v [T, Hkv * D] as computed here)."""
        if layer.layer_id != self.layer:
            return
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        positions = torch.tensor(self.positions, dtype=torch.int64, device=k.device)
        slots = torch.tensor(self.slots, dtype=torch.int64, device=k.device)
        # In the pool's units and rounding, so an fp8 pool's rounding does not count as deviation.
        new_k, new_v = pool.to_storage(layer.layer_id, k.view(-1, layer.num_kv_heads, layer.head_dim)[positions],
                                       v.view(-1, layer.num_kv_heads, layer.v_head_dim)[positions])
        new_k, new_v = to_kv_dtype(new_k, k_buf.dtype).float(), to_kv_dtype(new_v, v_buf.dtype).float()
        old_k, old_v = k_buf[slots].float(), v_buf[slots].float()
        dev = ((new_k - old_k).square().sum(-1) / (old_k.square().sum(-1) + EPS)).sum(-1)
        dev += ((new_v - old_v).square().sum(-1) / (old_v.square().sum(-1) + EPS)).sum(-1)
        self.scores[positions] += dev

    def finish(self, group=None) -> None:
        """After the forward: sum the ranks' scores (`group`: the tensor-parallel device group, None: one rank)."""
        if group is not None:
            dist.all_reduce(self.scores, group=group)

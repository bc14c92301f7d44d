"""The probe pass's scores: how much attention a request's question pays to each key of its row.

Beside whatever kernel computes the layer's output, the question's rows are attended once more in torch, over the
keys their request's row holds (read from the pool and rotated by their index, as every backend sees them), and each
key's probability is summed over the heads and the question's tokens into the request's score vector; summed over
the layers, that is ProphetKV's ranking of the tokens worth recomputing (managers/span_probe.py). Done outside the
kernels, so every attention backend gives the same scores. Under tensor parallelism each rank scores its own
heads and `finish` sums the ranks' scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sglang_pic.kernels.torch_native import rope_rotate

QUERY_BLOCK = 256  # question rows scored at once: their probabilities take heads x block x keys floats


FIELDS = 4  # integers per ProbeRows on the wire (to_list)


@dataclass
class ProbeRows:
    """One request's question rows in a batch: token rows [lo, hi), keys [0, seq_len) of table row `row`."""

    lo: int
    hi: int
    row: int
    seq_len: int
    scores: torch.Tensor  # [seq_len] float32 on the device: this forward's, summed into by every layer
    into: torch.Tensor | None = None  # the request's scores over its probe pass (rank 0): `finish` adds to them

    def to_list(self) -> list[int]:
        return [self.lo, self.hi, self.row, self.seq_len]


@dataclass
class AttentionProbe:
    items: list[ProbeRows] = field(default_factory=list)

    @classmethod
    def from_list(cls, values: list[int], device: torch.device) -> AttentionProbe:
        """A follower's probe for rank 0's items (its own scores, which `finish` hands to rank 0's)."""
        items = []
        for i in range(0, len(values), FIELDS):
            lo, hi, row, seq_len = values[i : i + FIELDS]
            items.append(ProbeRows(lo, hi, row, seq_len, torch.zeros(seq_len, dtype=torch.float32, device=device)))
        return cls(items)

    def to_list(self) -> list[int]:
        return [x for item in self.items for x in item.to_list()]

    def finish(self, group=None) -> None:
        """After the forward: sum the ranks' scores (`group`: the tensor-parallel device group, None: one rank) and
        add them to each request's."""
        for item in self.items:
            if group is not None:
                dist.all_reduce(item.scores, group=group)
            if item.into is not None:
                item.into[: item.seq_len] += item.scores

    def score(self, q: torch.Tensor, layer, forward_batch) -> None:
        """Add this layer's attention of each item's question rows (q [T, Hq * D], unrotated) to its scores."""
        pool = forward_batch.token_to_kv_pool
        k_buffer = pool.get_key_buffer(layer.layer_id)
        sm_scale = layer.scaling * pool.k_scale[layer.layer_id]  # the pool holds k / k_scale
        table = layer.rotary.cos_sin_cache
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        for item in self.items:
            slots = forward_batch.req_to_token_pool.req_to_token[item.row, : item.seq_len]
            key_pos = torch.arange(item.seq_len, device=q.device)
            keys = rope_rotate(k_buffer[slots], key_pos, table)  # [S, Hkv, D]
            keys = keys.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, S, D]
            for lo in range(item.lo, item.hi, QUERY_BLOCK):
                hi = min(lo + QUERY_BLOCK, item.hi)
                pos = forward_batch.positions[lo:hi]
                qr = rope_rotate(q[lo:hi].view(hi - lo, hq, d), pos, table).transpose(0, 1)  # [Hq, n, D]
                logits = torch.matmul(qr, keys.transpose(1, 2)) * sm_scale  # [Hq, n, S]
                logits.masked_fill_(key_pos[None, None, :] > pos[None, :, None], float("-inf"))
                item.scores += torch.softmax(logits, dim=-1).sum(dim=(0, 1))

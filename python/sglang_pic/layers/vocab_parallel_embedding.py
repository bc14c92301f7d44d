"""The token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

A rank looks up only the ids in its rows (zeros elsewhere) and the ranks' lookups are summed; for logits each rank
scores its rows and the slices are gathered. Shards are padded to equal size; padded rows are never read.
At tp_size 1 both are the plain lookup and matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_pic.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_group
from sglang_pic.distributed.sharding import vocab_shard


class VocabParallelEmbedding(nn.Module):
    """[vocab, hidden] table, this rank's rows only; also the LM head's storage (same split, so ties just work)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_size = tp.size
        self.shard = vocab_shard(vocab_size, tp.rank, tp.size)
        # Uninitialized on purpose: the loader (or the dummy init) fills it.
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size), requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        if loaded.shape != (self.shard.full, param.shape[1]):
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != {(self.shard.full, param.shape[1])}")
        rows = loaded[self.shard.start : self.shard.start + self.shard.size]
        with torch.no_grad():
            param[: rows.shape[0]].copy_(rows)
            param[rows.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Float32 logits [T, vocab] from a vocab-split LM head weight (every rank gets the full rows)."""
    logits = hidden @ weight.t()
    if get_tp_group().size > 1:
        logits = all_gather_last_dim(logits)[..., :vocab_size]
    return logits.float()

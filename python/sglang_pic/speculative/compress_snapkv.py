"""SnapKV: the prompt's last queries (the observation window) vote for the earlier keys worth keeping.

Each layer scores every earlier key by the attention the window's queries pay it (summed over the queries and the
query heads of its KV head), smooths the scores with a max-pool so neighbours of a strong token come along, and
keeps the best keys plus the newest quarter of the budget. SnapKV keeps only its observation window as the recent
part; a draft needs more, since the next tokens lean on local context (dropping recent tokens costs acceptance
far more than dropping old ones). SnapKV picks per head; a draft row is shared by a layer's heads (the kernels
read one token table per layer), so the heads' pooled votes are summed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sglang_pic.speculative.compressor_base import Compressor, register

WINDOW = 32
POOL_KERNEL = 7


@register
class SnapKVCompressor(Compressor):
    name = "snapkv"

    def observation(self, state: Any, num_tokens: int) -> int:
        return min(WINDOW, num_tokens)

    def select(self, num_tokens: int, budget: int, scores: torch.Tensor | None, state: Any) -> torch.Tensor:
        if num_tokens <= budget:
            return torch.arange(num_tokens)[None]
        assert scores is not None, "snapkv needs the observation window's attention"
        window = budget // 4
        candidates = num_tokens - window
        pooled = F.max_pool1d(
            scores[..., :candidates].float().cpu(), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2
        )[..., :candidates]
        votes = pooled.sum(dim=1)  # [layers, candidates]
        picked = votes.topk(budget - window, dim=-1).indices
        recent = torch.arange(candidates, num_tokens).expand(votes.shape[0], window)
        return torch.cat([picked, recent], dim=-1).sort(dim=-1).values

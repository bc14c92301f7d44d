"""StreamingLLM: keep a few attention-sink tokens at the start and a window of the most recent tokens.

Needs no scores, so building a draft is only index arithmetic; every layer keeps the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_pic.speculative.compressor_base import Compressor, register

NUM_SINKS = 4


@register
class StreamingCompressor(Compressor):
    name = "streaming"

    def select(self, num_tokens: int, budget: int, scores: torch.Tensor | None, state: Any) -> torch.Tensor:
        if num_tokens <= budget:
            return torch.arange(num_tokens)[None]
        sinks = min(NUM_SINKS, budget // 2)
        window = budget - sinks
        return torch.cat([torch.arange(sinks), torch.arange(num_tokens - window, num_tokens)])[None]

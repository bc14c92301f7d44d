"""H2O: keep the heavy hitters (the keys with the most accumulated attention) plus the most recent tokens.

H2O accumulates attention over every query it has seen. Here the queries are observed when a draft is compressed:
at the first compression the prompt's last OBSERVE_CAP tokens, at each later one the tokens verified since the
previous one (at most OBSERVE_CAP of them). The accumulated score of each key persists across compressions in the
request's state, per layer; half the budget goes to heavy hitters and half to the recent window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_pic.speculative.compressor_base import Compressor, register

OBSERVE_CAP = 128


@dataclass
class H2OState:
    scores: torch.Tensor | None = None  # [layers, tokens] accumulated attention (summed over heads), on the CPU
    observed: int = 0  # queries of tokens [0, observed) have been accumulated (or skipped past the cap)


@register
class H2OCompressor(Compressor):
    name = "h2o"

    def new_state(self) -> H2OState:
        return H2OState()

    def observation(self, state: H2OState, num_tokens: int) -> int:
        return min(num_tokens - state.observed, OBSERVE_CAP)

    def select(self, num_tokens: int, budget: int, scores: torch.Tensor | None, state: H2OState) -> torch.Tensor:
        self._accumulate(state, scores, num_tokens)
        if num_tokens <= budget:
            return torch.arange(num_tokens)[None]
        assert state.scores is not None, "h2o needs observed attention before it can pick heavy hitters"
        heavy = budget // 2
        recent = budget - heavy
        candidates = num_tokens - recent
        picked = state.scores[:, :candidates].topk(heavy, dim=-1).indices
        window = torch.arange(candidates, num_tokens).expand(picked.shape[0], recent)
        return torch.cat([picked, window], dim=-1).sort(dim=-1).values

    @staticmethod
    def _accumulate(state: H2OState, scores: torch.Tensor | None, num_tokens: int) -> None:
        if scores is not None:
            fresh = scores.float().sum(dim=1).cpu()  # [layers, keys]
            if state.scores is None:
                state.scores = torch.zeros((fresh.shape[0], 0))
            if state.scores.shape[1] < num_tokens:
                pad = torch.zeros((state.scores.shape[0], num_tokens - state.scores.shape[1]))
                state.scores = torch.cat([state.scores, pad], dim=1)
            state.scores[:, : fresh.shape[1]] += fresh
        state.observed = num_tokens

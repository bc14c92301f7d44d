"""One decode step's sampling parameters as batched tensors, so the sampler treats the whole batch at once.

Rebuilt every step from the running requests. The costly parts (per-token counts for penalties, kept between
steps in PenaltyCounts; dense logit-bias rows) are built only when some request in the batch asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.sampling.penalty_counts import PenaltyCounts
from sglang_pic.utils_tensor import upload

if TYPE_CHECKING:
    from sglang_pic.managers.req import Req


@dataclass
class SamplingBatchInfo:
    vocab_size: int  # width of the logits the sampler will get
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows so the division is harmless
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, -1 replaced by vocab_size
    min_ps: torch.Tensor  # [B] float32
    greedy_mask: torch.Tensor  # [B] bool
    greedy_rows: list[bool]  # the same on the host, read without a device sync
    is_all_greedy: bool
    need_top_k_top_p: bool  # some sampled row truncates by rank or nucleus
    max_top_k: int  # largest top_k below vocab_size among sampled rows, 0 if none
    need_min_p: bool
    generators: list[torch.Generator | None]  # per request; None draws from the global RNG
    seeded_rows: list[int]  # sampled rows whose noise comes from their own generator
    # Penalties; each group is None when no row uses it.
    frequency_penalties: torch.Tensor | None = None  # [B, 1]
    presence_penalties: torch.Tensor | None = None  # [B, 1]
    output_counts: torch.Tensor | None = None  # [B, V] float32, occurrences of each token in the output
    repetition_penalties: torch.Tensor | None = None  # [B, 1]
    seen_mask: torch.Tensor | None = None  # [B, V] bool, token occurs in prompt or output
    logit_bias: torch.Tensor | None = None  # [B, V] float32
    # (row, token) pairs forced to -inf because the row is still below its min_new_tokens.
    ban_rows: torch.Tensor | None = None
    ban_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @classmethod
    def from_requests(
        cls,
        reqs: list[Req],
        vocab_size: int,
        device: torch.device | str,
        penalties: PenaltyCounts,
        extras: list[list[int]] | None = None,
        uncommitted: list[int] | None = None,
    ) -> SamplingBatchInfo:
        """Row i samples request i's next token as if it had also output `extras[i]` (drafted tokens): penalties
        count them and the min_new_tokens ban follows the longer output. `uncommitted[i]` more tokens were sampled
        for request i but are not in its output yet (overlap scheduling): penalties have them already
        (PenaltyCounts.add_sampled), the ban counts them."""
        batch = len(reqs)
        if extras is not None and len(extras) != batch:
            raise ValueError(f"{len(extras)} extra-token lists for a batch of {batch} requests")
        params = [r.sampling_params for r in reqs]
        generators = [r.generator for r in reqs]
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        # One upload per dtype rather than one per field.
        floats = upload(temperatures, top_ps, min_ps, device=device, dtype=torch.float32).view(3, batch)
        ints = upload(top_ks, greedy, device=device).view(2, batch)
        info = cls(
            vocab_size=vocab_size,
            temperatures=floats[0].unsqueeze(1),
            top_ps=floats[1],
            top_ks=ints[0],
            min_ps=floats[2],
            greedy_mask=ints[1].bool(),
            greedy_rows=greedy,
            is_all_greedy=all(greedy),
            need_top_k_top_p=any(
                not g and (k < vocab_size or p < 1.0) for g, k, p in zip(greedy, top_ks, top_ps)
            ),
            max_top_k=max((k for g, k in zip(greedy, top_ks) if not g and k < vocab_size), default=0),
            need_min_p=any(not g and m > 0.0 for g, m in zip(greedy, min_ps)),
            generators=generators,
            seeded_rows=[i for i, (g, gen) in enumerate(zip(greedy, generators)) if not g and gen is not None],
        )

        linear = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        if linear or repetition:
            history = penalties.history(reqs, extras, want_seen=repetition)
            if linear:
                info.frequency_penalties = _floats([p.frequency_penalty for p in params], device).unsqueeze(1)
                info.presence_penalties = _floats([p.presence_penalty for p in params], device).unsqueeze(1)
                info.output_counts = history.output_counts
            if repetition:
                info.repetition_penalties = _floats([p.repetition_penalty for p in params], device).unsqueeze(1)
                info.seen_mask = history.seen

        if any(p.logit_bias for p in params):
            info.logit_bias = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
            for i, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
                    info.logit_bias[i, ids] = _floats(list(p.logit_bias.values()), device)

        ban = [
            (i, t)
            for i, req in enumerate(reqs)
            if len(req.output_ids) + (len(extras[i]) if extras else 0) + (uncommitted[i] if uncommitted else 0)
            < req.sampling_params.min_new_tokens
            for t in sorted(set(req.eos_token_ids) | set(req.sampling_params.stop_token_ids or []))
        ]
        if ban:
            info.ban_rows = torch.tensor([i for i, _ in ban], dtype=torch.int64, device=device)
            info.ban_ids = torch.tensor([t for _, t in ban], dtype=torch.int64, device=device)
        return info


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)

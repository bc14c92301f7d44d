"""One decode step's sampling parameters as batched tensors, so the sampler treats the whole batch at once.

Rebuilt every step from the running requests. The costly parts (per-token count tensors for penalties, dense
logit-bias rows) are built only when some request in the batch asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.utils_tensor import upload


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
        params: list[SamplingParams],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: list[set[int]],
        generators: list[torch.Generator | None],
    ) -> SamplingBatchInfo:
        """`eos_token_ids[i]`: ids banned while request i is below min_new_tokens (stop_token_ids included)."""
        batch = len(params)
        if not all(len(x) == batch for x in (output_ids, prompt_ids, eos_token_ids, generators)):
            raise ValueError("per-request inputs of SamplingBatchInfo.from_requests differ in length")

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
            generators=list(generators),
            seeded_rows=[i for i, (g, gen) in enumerate(zip(greedy, generators)) if not g and gen is not None],
        )

        linear = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        if any(linear):
            info.frequency_penalties = _floats([p.frequency_penalty for p in params], device).unsqueeze(1)
            info.presence_penalties = _floats([p.presence_penalty for p in params], device).unsqueeze(1)
            rows = [out if use else [] for out, use in zip(output_ids, linear)]
            info.output_counts = _token_counts(rows, vocab_size, device)

        repetition = [p.repetition_penalty != 1.0 for p in params]
        if any(repetition):
            info.repetition_penalties = _floats([p.repetition_penalty for p in params], device).unsqueeze(1)
            rows = [list(chain(pr, out)) if use else [] for pr, out, use in zip(prompt_ids, output_ids, repetition)]
            info.seen_mask = _token_counts(rows, vocab_size, device) > 0

        if any(p.logit_bias for p in params):
            info.logit_bias = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
            for i, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
                    info.logit_bias[i, ids] = _floats(list(p.logit_bias.values()), device)

        ban = [
            (i, t)
            for i, (p, out, eos) in enumerate(zip(params, output_ids, eos_token_ids))
            if len(out) < p.min_new_tokens
            for t in sorted(eos)
        ]
        if ban:
            info.ban_rows = torch.tensor([i for i, _ in ban], dtype=torch.int64, device=device)
            info.ban_ids = torch.tensor([t for _, t in ban], dtype=torch.int64, device=device)
        return info


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] float32 occurrence counts of each token id per row."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
    ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64, device=device)
    if ids.numel():
        row_idx = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
        counts.index_put_((row_idx, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts
